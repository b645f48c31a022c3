"""The text layer around token-level generation: the model's tokenizer and stop ids
(`TextTokenizer`), its chat template (`ChatTemplate`), incremental detokenization that
never emits broken UTF-8 (`IncrementalDetokenizer`) and stop strings matched across
token boundaries (`StopMatcher`). Used by the gateway; no asyncio, no protobuf here."""

from __future__ import annotations

from moetier.text.detokenize import IncrementalDetokenizer
from moetier.text.stops import StopMatcher
from moetier.text.template import ChatTemplate
from moetier.text.tokenizer import TextTokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopMatcher", "TextTokenizer"]
