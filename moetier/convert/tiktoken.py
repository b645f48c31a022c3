"""tiktoken-style tokenizers (Kimi K2 / K2.5's `tiktoken.model`) as a Hugging Face tokenizer.json,
built with `tokenizers`: what `moetier convert` writes into the container when a source ships
tiktoken.model and no tokenizer.json, so the gateway and the dense worker read one format.

transformers 5.24 loads such a file through `TikTokenConverter` with its default (cl100k-like)
split pattern unless the model's remote tokenizer code is run; moetier runs no remote code and
uses the pattern Moonshot's `tokenization_kimi.py` defines (Han runs split apart from other
letters by character-class intersection, which the `tokenizers` regex engine supports), the
special tokens of tokenizer_config.json's `added_tokens_decoder`, and `<|reserved_token_{id}|>`
for the unnamed ids of the 256 reserved after the base vocabulary.

The BPE is tiktoken's: the vocabulary is the rank file (bytes -> rank, as GPT-2 byte-level
strings), and the merges are every split of a token into two tokens, ordered by the merged
token's rank, so a merge step picks the pair whose merge has the lowest rank, as tiktoken does.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from moetier.errors import FormatError

TIKTOKEN_FILE = "tiktoken.model"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
RESERVED_SPECIAL = 256  # ids after the base vocabulary kept for special tokens


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one `base64(token) rank` per line; ranks 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    for no, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError) as e:
            raise FormatError(f"{path}: line {no} is not 'base64-token rank' ({e})") from None
        if token in ranks:
            raise FormatError(f"{path}: line {no}: token {token!r} appears twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FormatError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def tokenizer_from_tiktoken(path: Path, tokenizer_config: dict[str, Any] | None = None,
                            pattern: str = KIMI_PATTERN) -> Tokenizer:
    ranks = read_ranks(path)
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges: list[tuple[int, str, str]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, text(left), text(right)))
    merges.sort()
    bpe = models.BPE(vocab, [(a, b) for _, a, b in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    named = {int(i): (t["content"] if isinstance(t, dict) else str(t))
             for i, t in ((tokenizer_config or {}).get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    top = max([base + RESERVED_SPECIAL - 1, *named]) if named else base - 1
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(base, top + 1)]
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    for i, s in enumerate(specials, base):
        if tok.token_to_id(s) != i:
            raise FormatError(f"{path}: special token {s!r} would get id {tok.token_to_id(s)}, not {i}")
    return tok


def tokenizer_json(root: Path) -> bytes | None:
    """tokenizer.json for a source directory that ships only tiktoken.model (else None)."""
    if (root / "tokenizer.json").is_file() or not (root / TIKTOKEN_FILE).is_file():
        return None
    cfg_path = root / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return tokenizer_from_tiktoken(root / TIKTOKEN_FILE, cfg).to_str().encode()
