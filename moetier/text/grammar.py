"""Structured outputs: grammars compiled by llguidance against the model's tokenizer, and
the per-sequence matchers that turn them into token masks.

Legend: B = constrained sequences in a step, V = the model's vocab, W = ceil(V / 32).

Why llguidance (over xgrammar and outlines-core): it compiles a JSON schema or a Lark
grammar lazily (no ahead-of-time automaton over the whole vocabulary, so a new schema per
request costs milliseconds, not seconds), computes a mask in tens of microseconds with no
torch dependency, refuses what it cannot enforce with a message naming the keyword
("Unimplemented keys: [\"uniqueItems\"]"), embeds JSON schemas inside Lark (`%json{...}`),
which a tool-call format around the arguments needs, fills the masks of a whole batch in
parallel (`LLExecutor`), and its matcher can roll back and validate several tokens at once,
which speculative decoding needs.

    compiler = GrammarCompiler.from_dir(model_dir, vocab_size)  # once per process
    grammar = json_schema_grammar(schema)        # a grammar string (the proto carries it)
    compiler.check(grammar)                      # InvalidArgument naming the problem
    m = compiler.matcher(grammar)                # one per sequence
    masks = fill_masks([m1, m2], V)              # [B, V] bool, one call for the batch
    m.accept(token)                              # after sampling
    m.rollback(k) / m.validate(drafts)           # speculation: undo k tokens / how many drafts fit

The grammar travels as llguidance's own grammar text (its JSON form): the gateway builds
and checks it, the dense worker builds a matcher for it. Once the grammar is complete only
the stop (eos) tokens are allowed, so a constrained generation ends exactly where it is
complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from moetier.errors import FormatError, InvalidArgument

# Compact JSON: no free whitespace (a weak model would spend its budget on it), and the
# separators OpenAI's own structured outputs use.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_EXECUTOR: llguidance.LLExecutor | None = None


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON values matching `schema` (None: any JSON object, OpenAI's json_object)."""
    target = {"type": "object"} if schema is None else schema
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(target, overrides=JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as e:
        raise InvalidArgument(f"the JSON schema is not usable: {e}") from None


def lark_grammar(lark: str) -> str:
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark expression matching the JSON values of `schema`, with the compact separators."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """llguidance's tokenizer for one model: built once (it indexes the vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise FormatError("structured outputs need the model's stop token ids (generation_config.json)")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    @classmethod
    def from_dir(cls, path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        file = Path(path) / "tokenizer.json"
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as e:
            raise FormatError(f"{file}: {e.strerror or e}") from None
        return cls(text, vocab_size, eos_token_ids)

    def check(self, grammar: str) -> None:
        """InvalidArgument naming what the grammar asks for that cannot be enforced."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise InvalidArgument(f"the grammar cannot be enforced: {problem.strip()}")

    def matcher(self, grammar: str) -> GrammarMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidArgument(f"the grammar cannot be enforced: {m.get_error().strip()}")
        return GrammarMatcher(m, self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m

    def allowed(self) -> npt.NDArray[np.bool_]:
        """[V] True where the next token may go."""
        return fill_masks([self], self.vocab_size)[0]

    def accept(self, token: int) -> None:
        """Advance by a sampled token; a token the mask did not allow is a bug (RuntimeError)."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"grammar matcher refused token {token}: {self._m.get_error()}")

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts) the grammar allows in a row, without advancing."""
        return int(self._m.validate_tokens(list(tokens)))

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (rejected drafts)."""
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher cannot roll back {n} tokens: {self._m.get_error()}")

    @property
    def accepting(self) -> bool:
        """The text so far is complete under the grammar."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def fill_masks(matchers: Iterable[GrammarMatcher], vocab_size: int) -> npt.NDArray[np.bool_]:
    """[B, V] allowed tokens of each matcher, computed in parallel in one call."""
    ms = list(matchers)
    bits = allocate_token_bitmask(len(ms), vocab_size)  # [B, W] int32, bit t of word t // 32
    if ms:
        fill_next_token_bitmask_par(_executor(), [(m.raw, i) for i, m in enumerate(ms)], bits)
    as_bytes = bits.view(np.uint8).reshape(len(ms), -1)  # little-endian words: byte order = bit order
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size].astype(bool)


# ---- fitting a schema to the token budget -----------------------------------------------------
# A grammar bounds the shape of an answer, not its length: an unbounded string, number or
# array lets a weak model run past max_tokens, and a truncated answer parses as nothing.
# `fit_schema` narrows a schema so that every instance fits the budget, in the worst case of
# one token per byte (a string character may be 6 bytes: a JSON escape). Only what the schema
# leaves open is bounded, and only within what it allows: a narrowed schema's instances
# are instances of the original, so an answer that validates against one validates against
# the other. Strings with a pattern, format, enum or const, and $refs, are left as they are.
STRING_BYTES_PER_CHAR = 6
NUMBER_MAGNITUDE = 10**9  # |x| bound for numbers the schema does not bound
NUMBER_DECIMALS = 4  # digits after the point for numbers without multipleOf
ARRAY_ITEMS = 8  # most items of an array without maxItems (within the budget)
_UNBOUNDED_STRING_KEYS = ("pattern", "format", "enum", "const", "contentEncoding")


def fit_schema(schema: Any, budget: int) -> Any:
    """A narrower copy of `schema` whose instances take at most about `budget` tokens."""
    if not isinstance(schema, dict):
        return schema
    s = dict(schema)
    if "$ref" in s or "enum" in s or "const" in s:
        return s
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            s[key] = [fit_schema(b, budget) for b in s[key]]
    if isinstance(s.get("allOf"), list):
        s["allOf"] = [fit_schema(b, budget) for b in s["allOf"]]
    types = s.get("type")
    kinds = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if "string" in kinds and not any(k in s for k in _UNBOUNDED_STRING_KEYS):
        room = max(0, (budget - 2) // STRING_BYTES_PER_CHAR)
        bound = max(int(s.get("minLength", 0)), room)  # never below the schema's own minimum
        s["maxLength"] = min(int(s["maxLength"]), bound) if "maxLength" in s else bound
    if kinds & {"number", "integer"}:
        _bound_number(s, integer=kinds <= {"integer"})
    if "array" in kinds:
        _fit_array(s, budget)
    if "object" in kinds or "properties" in s:
        _fit_object(s, budget)
    return s


def _bounds(s: dict[str, Any]) -> tuple[float | None, float | None]:
    lo, hi = s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum", s.get("exclusiveMaximum"))
    return (lo if isinstance(lo, int | float) else None), (hi if isinstance(hi, int | float) else None)


def _bound_number(s: dict[str, Any], integer: bool) -> None:
    lo, hi = _bounds(s)
    if lo is None and hi is None:
        s["minimum"], s["maximum"] = -NUMBER_MAGNITUDE, NUMBER_MAGNITUDE
    elif lo is None and hi is not None:
        s["minimum"] = hi - 2 * NUMBER_MAGNITUDE
    elif hi is None and lo is not None:
        s["maximum"] = lo + 2 * NUMBER_MAGNITUDE
    lo, hi = _bounds(s)
    if not integer and "multipleOf" not in s and lo is not None and hi is not None:
        decimals = NUMBER_DECIMALS
        while decimals < 12 and (hi - lo) * 10**decimals < 4:  # keep a few multiples inside the range
            decimals += 1
        s["multipleOf"] = 10.0**-decimals


def _fit_array(s: dict[str, Any], budget: int) -> None:
    least = int(s.get("minItems", 0))
    prefix: list[Any] = s["prefixItems"] if isinstance(s.get("prefixItems"), list) else []
    most = int(s.get("maxItems", max(least, ARRAY_ITEMS)))
    most = max(least, min(most, ARRAY_ITEMS if "maxItems" not in s else most, max(len(prefix), least, 1) * 64))
    s["maxItems"] = most
    share = max(1, (budget - 2) // max(1, most)) - 2
    if prefix:
        s["prefixItems"] = [fit_schema(p, share) for p in prefix]
    if isinstance(s.get("items"), dict):
        s["items"] = fit_schema(s["items"], share)


def _fit_object(s: dict[str, Any], budget: int) -> None:
    props: dict[str, Any] = s["properties"] if isinstance(s.get("properties"), dict) else {}
    required = [r for r in s.get("required", []) if isinstance(r, str)]
    if "additionalProperties" not in s and all(r in props for r in required):
        s["additionalProperties"] = False  # extra keys would be unbounded; declared ones suffice
    if props:
        keys = sum(len(k) + 4 for k in props)
        share = max(1, (budget - 2 - keys) // len(props))
        s["properties"] = {k: fit_schema(v, share) for k, v in props.items()}
