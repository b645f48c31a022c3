"""What the gateway needs to know about the model it serves, read from the model directory
(the container): its name, its context length and its tokenizer. Only the JSON and
tokenizer files are read; the weights are the workers' business."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetier.errors import FormatError
from moetier.settings import Settings
from moetier.text.tokenizer import TextTokenizer, read_json


def default_model_dir(settings: Settings) -> Path:
    """`model.path`, else the demo model that `moetier up` builds."""
    return (settings.model.path or settings.data_path / "models" / "demo").expanduser()


@dataclass(frozen=True)
class ServedModel:
    name: str  # the `model` clients send
    path: Path
    tokenizer: TextTokenizer
    max_position_embeddings: int | None  # None: unknown, the settings decide alone
    created: int  # unix time of the directory, for /v1/models

    @classmethod
    def from_dir(cls, path: Path, name: str | None = None) -> ServedModel:
        path = Path(path)
        if not path.is_dir():
            raise FormatError(f"model directory {path} does not exist (give --model DIR or model.path)")
        manifest = read_json(path / "moetier.json").get("model") or {}
        config = read_json(path / "config.json")
        mpe = manifest.get("max_position_embeddings", config.get("max_position_embeddings"))
        return cls(
            name=name or path.resolve().name,
            path=path,
            tokenizer=TextTokenizer.from_dir(path),
            max_position_embeddings=int(mpe) if isinstance(mpe, int) and mpe > 0 else None,
            created=int(path.stat().st_mtime),
        )

    def context_limit(self, max_seq_len: int) -> int:
        """Prompt + completion tokens one request may use."""
        if self.max_position_embeddings is None:
            return max_seq_len
        return min(max_seq_len, self.max_position_embeddings)
