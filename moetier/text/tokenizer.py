"""The model's tokenizer as the gateway uses it, read from a model directory.

Files (Hugging Face names, copied into the container by the converter):
  tokenizer.json          the `tokenizers` model (required)
  tokenizer_config.json   special tokens (bos_token, eos_token, ...) and chat_template
  chat_template.jinja     the chat template, where newer checkpoints keep it
  generation_config.json  eos_token_id (int or list): the ids that end a generation
  config.json             eos_token_id fallback
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from moetier.errors import FormatError
from moetier.text.template import ChatTemplate

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from the model directory; {} when the file is absent."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, special_tokens: dict[str, str | None] | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.chat_template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        decoder = tokenizer.decoder
        self._byte_level = decoder is not None and b"ByteLevel" in decoder.__getstate__()

    @classmethod
    def from_dir(cls, path: Path) -> TextTokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FormatError(f"{path}: no tokenizer.json (the gateway needs the model's tokenizer)")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises plain Exception on bad files
            raise FormatError(f"{tok_file}: not a tokenizers file ({e})") from None
        config = read_json(path / "tokenizer_config.json")
        special = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        eos: set[int] = set(_ids(read_json(path / "generation_config.json").get("eos_token_id")))
        if not eos:
            eos.update(_ids(read_json(path / "config.json").get("eos_token_id")))
        if special["eos_token"] is not None and (tid := tokenizer.token_to_id(special["eos_token"])) is not None:
            eos.add(tid)
        return cls(tokenizer, special_tokens=special, eos_token_ids=eos,
                   chat_template=template if isinstance(template, str) else None)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. A rendered chat template already holds its special tokens:
        encode it with add_special_tokens=False (as transformers does)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text on its own (special tokens included; may hold U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to the output (for logprobs `bytes`)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.token_text(token_id).encode("utf-8")
