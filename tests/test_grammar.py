"""Grammars and matchers (llguidance) on the project tokenizer, without a model: whatever a
matcher lets through is valid, so walks that pick random allowed tokens stand for the worst
possible model. Over generated JSON schemas, fitted to a token budget, every walk ends
within the budget in JSON that validates against the original schema; forced tool calls in
every family's format parse back as calls whose arguments validate; masks batch; matchers
roll back and validate drafts; what cannot be enforced is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.convert.tokenizer import tokenizer_files
from moetier.errors import InvalidArgument
from moetier.text.conversation import CallDelta, ToolDef
from moetier.text.grammar import GrammarCompiler, fill_masks, fit_schema, json_schema_grammar, lark_grammar
from moetier.text.tokenizer import TextTokenizer
from moetier.text.tools import FORMATS, ToolStream, literal_marker

VOCAB = 1024
BUDGET = 200


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    d = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files(VOCAB, 4096).items():
        (d / name).write_bytes(data)
    return TextTokenizer.from_dir(d)


@pytest.fixture(scope="module")
def compiler(tok: TextTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok.tokenizer.to_str(), VOCAB, tok.eos_token_ids)


def walk(compiler: GrammarCompiler, tok: TextTokenizer, grammar: str, seed: int, limit: int = 4 * BUDGET) -> str:
    """Random allowed tokens (never a stop token while another is allowed) until only stops remain."""
    rng = np.random.default_rng(seed)
    m = compiler.matcher(grammar)
    ids: list[int] = []
    stops = set(tok.eos_token_ids)
    while len(ids) < limit:
        allowed = np.flatnonzero(m.allowed())
        assert len(allowed), "the mask allows nothing"
        go = [t for t in allowed if t not in stops]
        if not go:
            break
        t = int(rng.choice(go))
        m.accept(t)
        ids.append(t)
    assert len(ids) <= BUDGET, f"{len(ids)} tokens for a budget of {BUDGET}"
    assert m.accepting
    return tok.decode(ids)


# Schemas as the JSON-schema features of the issue: nesting, enums, bounds, required and
# optional fields, arrays.
_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda a, b: {"type": "string", "minLength": min(a, b), "maxLength": max(a, b)},
              st.integers(0, 5), st.integers(0, 12)),
    st.just({"type": "integer"}),
    st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)},
              st.integers(-1000, 1000), st.integers(-1000, 1000)),
    st.builds(lambda a: {"type": "number", "minimum": a}, st.integers(-50, 50)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": sorted(set(xs))}, st.lists(_names, min_size=1, max_size=4)),
)


def _object(children: st.SearchStrategy[dict[str, object]]) -> st.SearchStrategy[dict[str, object]]:
    def build(props: dict[str, dict[str, object]], req: list[bool]) -> dict[str, object]:
        names = list(props)
        return {"type": "object", "properties": props,
                "required": [n for n, r in zip(names, req, strict=False) if r]}

    return st.builds(build, st.dictionaries(_names, children, min_size=1, max_size=4),
                     st.lists(st.booleans(), min_size=4, max_size=4))


SCHEMAS = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "minItems": n}, children, st.integers(0, 2)),
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_fitted_schemas_end_valid_within_the_budget(compiler: GrammarCompiler, tok: TextTokenizer,
                                                    schema: dict[str, object], seed: int) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    grammar = json_schema_grammar(fit_schema(schema, BUDGET))
    compiler.check(grammar)
    jsonschema.validate(json.loads(walk(compiler, tok, grammar, seed)), schema)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(schema=SCHEMAS.filter(lambda s: s.get("type") == "object"), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(sorted(FORMATS)))
def test_forced_calls_in_every_format_parse_and_validate(compiler: GrammarCompiler, tok: TextTokenizer,
                                                         schema: dict[str, object], seed: int, fmt: str) -> None:
    flat = fmt == "glm45"  # GLM's arg_key/arg_value pairs write one property per pair
    if flat:
        schema = {**schema, "properties": {k: v for k, v in schema["properties"].items()  # type: ignore[attr-defined]
                                          if v.get("type") in ("string", "integer", "boolean")} or
                  {"x": {"type": "integer"}}}
        schema["required"] = [r for r in schema["required"] if r in schema["properties"]]  # type: ignore[attr-defined]
    tools = [ToolDef("lookup", None, fit_schema(schema, BUDGET - 40)), ToolDef("other", None, {"type": "object"})]
    grammar = lark_grammar(FORMATS[fmt].forced_lark(tools[:1], literal_marker))
    compiler.check(grammar)
    text = walk(compiler, tok, grammar, seed)
    s = ToolStream(FORMATS[fmt], tools)
    calls = [e for e in s.feed(text) + s.close() if isinstance(e, CallDelta)]
    assert [c.call.name for c in calls] == ["lookup"], text
    jsonschema.validate(json.loads(calls[0].call.arguments), schema)


def test_fit_schema_narrows_only_what_is_open() -> None:
    s = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "string"},
                                          "c": {"type": "array", "items": {"type": "integer"}},
                                          "d": {"type": "string", "pattern": "^x+$"}}, "required": ["a"]}
    f = fit_schema(s, 400)
    assert f["properties"]["a"] == {"type": "string", "maxLength": 3}
    assert 0 < f["properties"]["b"]["maxLength"] < 400
    assert f["properties"]["c"]["maxItems"] >= 1 and "maximum" in f["properties"]["c"]["items"]
    assert f["properties"]["d"] == {"type": "string", "pattern": "^x+$"}
    assert f["additionalProperties"] is False
    assert s["properties"]["b"] == {"type": "string"}  # the original is untouched
    assert fit_schema({"type": "string", "minLength": 500}, 10)["maxLength"] == 500  # never below its minimum


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_what_cannot_be_enforced_is_refused(compiler: GrammarCompiler, schema: dict[str, object],
                                            problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        compiler.check(json_schema_grammar(schema))
    with pytest.raises(InvalidArgument):
        compiler.matcher(json_schema_grammar(schema))


def test_masks_batch_and_matchers_roll_back(compiler: GrammarCompiler, tok: TextTokenizer) -> None:
    g1, g2 = json_schema_grammar({"type": "boolean"}), json_schema_grammar({"type": "array"})
    a, b = compiler.matcher(g1), compiler.matcher(g2)
    both = fill_masks([a, b], VOCAB)
    assert both.shape == (2, VOCAB)
    assert (both[0] == a.allowed()).all() and (both[1] == b.allowed()).all() and (both[0] != both[1]).any()
    ids = tok.encode("true", add_special_tokens=False)
    assert a.validate(ids) == len(ids) and a.validate(tok.encode("[1]", add_special_tokens=False)) == 0
    before = a.allowed()
    for t in ids:
        a.accept(t)
    assert a.accepting and set(np.flatnonzero(a.allowed())) <= set(tok.eos_token_ids)
    a.rollback(len(ids))
    assert (a.allowed() == before).all() and not a.accepting
    with pytest.raises(RuntimeError, match="refused"):
        a.accept(tok.encode("[", add_special_tokens=False)[0])


def test_from_dir_reads_the_model_tokenizer(tmp_path: Path, tok: TextTokenizer) -> None:
    for name, data in tokenizer_files(VOCAB, 4096).items():
        (tmp_path / name).write_bytes(data)
    c = GrammarCompiler.from_dir(tmp_path, VOCAB + 64, tok.eos_token_ids)  # a model vocab larger than the tokenizer's
    assert c.matcher(json_schema_grammar({"type": "integer"})).allowed().shape == (VOCAB + 64,)
