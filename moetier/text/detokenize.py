"""Incremental detokenization that never emits broken UTF-8.

Token boundaries do not fall on character boundaries: a byte-level BPE token may carry
half of a multi-byte character, which decodes to U+FFFD until the next token completes
it. Decoding every step's ids from scratch is quadratic, so we decode a short window:

    ids:  ... | prefix_offset ......... read_offset ........ end
                \\_ already emitted _/  \\_ not yet emitted _/

text(prefix_offset:end) minus text(prefix_offset:read_offset) is the new text. The
window starts one step back so decoders that treat the first token specially (a
SentencePiece leading space) decode the new tokens as they would mid-sequence. New text
that ends in U+FFFD is held back until a later token resolves it. `flush()` at the end of
the stream returns whatever is left of the one-shot decode of all ids, so the emitted
pieces always concatenate to exactly `decode(all ids)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    def add(self, ids: Sequence[int]) -> str:
        """Append token ids; return the new text that is complete (possibly empty)."""
        self._ids.extend(ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT) or not full.startswith(prefix):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(new)
        return new

    def flush(self) -> str:
        """End of stream: the rest of the one-shot decode, held-back bytes included."""
        full = self._decode(self._ids)
        done = "".join(self._emitted)
        if not full.startswith(done):  # a decoder that is not prefix-stable; never seen in practice
            log.warning("incremental decode diverged from the one-shot decode; %d chars lost", len(full))
            return ""
        rest = full[len(done) :]
        self._emitted = [full]
        self._prefix_offset = self._read_offset = len(self._ids)
        return rest
