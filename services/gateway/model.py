"""What the gateway needs to know about the model it serves, read from the model directory
(the container): its name, its context length, its tokenizer and chat template, its
tool-call format and the structured-output grammar compiler. Only the JSON and tokenizer
files are read; the weights are the workers' business."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from moetier.errors import FormatError
from moetier.settings import Settings
from moetier.text.grammar import GrammarCompiler
from moetier.text.tokenizer import TextTokenizer, read_json
from moetier.text.tools import ToolFormat, choose_format


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
    architecture: str | None = None  # config.json model_type
    vocab_size: int | None = None  # the model's (may exceed the tokenizer's)
    tool_format: ToolFormat | None = field(default=None, compare=False)  # None: the template renders no tools

    @classmethod
    def from_dir(cls, path: Path, name: str | None = None, tool_parser: str | None = None) -> ServedModel:
        path = Path(path)
        if not path.is_dir():
            raise FormatError(f"model directory {path} does not exist (give --model DIR or model.path)")
        manifest = read_json(path / "moetier.json").get("model") or {}
        config = read_json(path / "config.json")
        mpe = manifest.get("max_position_embeddings", config.get("max_position_embeddings"))
        tokenizer = TextTokenizer.from_dir(path)
        arch = config.get("model_type") if isinstance(config.get("model_type"), str) else None
        vocab = config.get("vocab_size")
        template = tokenizer.chat_template.source if tokenizer.chat_template else None
        return cls(
            name=name or path.resolve().name,
            path=path,
            tokenizer=tokenizer,
            max_position_embeddings=int(mpe) if isinstance(mpe, int) and mpe > 0 else None,
            created=int(path.stat().st_mtime),
            architecture=arch,
            vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
            tool_format=choose_format(template, arch, tool_parser),
        )

    def context_limit(self, max_seq_len: int) -> int:
        """Prompt + completion tokens one request may use."""
        if self.max_position_embeddings is None:
            return max_seq_len
        return min(max_seq_len, self.max_position_embeddings)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """llguidance's view of the tokenizer (built on first use: it indexes the vocabulary)."""
        tok = self.tokenizer
        return GrammarCompiler(tok.tokenizer.to_str(), max(self.vocab_size or 0, tok.vocab_size), tok.eos_token_ids)
