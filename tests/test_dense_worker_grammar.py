"""Structured outputs in the dense worker: a grammar masks the sampler of its own sequence,
batched beside unconstrained ones (which stay bit-identical to the engine), composes with the
prefix cache (a cached prompt gives the same constrained answer), reports its mask time, and
a grammar that cannot be built is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import jsonschema
import pytest
from test_dense_worker import cluster, collect, engines, models, prompt_of, reference, request, tokens

from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.text.grammar import fit_schema, json_schema_grammar
from moetier.text.tokenizer import TextTokenizer

__all__ = ["engines", "models"]  # fixtures
pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n", "tags"]}


def _text(model: Path, msgs: list[object]) -> str:
    tok = TextTokenizer.from_dir(model)
    ids = [t for t in tokens(msgs) if t not in tok.eos_token_ids]  # type: ignore[arg-type]
    return tok.decode(ids)


async def test_constrained_beside_unconstrained(models: dict[str, Path], engines: dict[str, Engine],
                                                tmp_path: Path) -> None:
    model = models["deepseek_v3"]
    tok = TextTokenizer.from_dir(model)
    stops = list(tok.eos_token_ids)
    grammar = json_schema_grammar(fit_schema(SCHEMA, 80))
    free = prompt_of(20, 3)
    expected = reference(engines["deepseek_v3"], free, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    async with cluster(model, tmp_path) as c:
        reqs = [request(prompt_of(9 + i, i), 120, temperature=0.0 if i % 2 else 0.8, seed=i, rid=f"g{i}",
                        grammar=grammar, stop_token_ids=stops) for i in range(3)]
        got = await asyncio.gather(*(collect(c.stub, r) for r in reqs), collect(c.stub, request(free, 12, rid="f")))
        for msgs in got[:3]:
            assert msgs[-1].finish_reason == "stop"  # the grammar completed and allowed the stop token
            jsonschema.validate(json.loads(_text(model, msgs)), SCHEMA)
            assert sum(m.timings.mask_ns for m in msgs) > 0
        assert tokens(got[3]) == expected  # the unconstrained neighbour is untouched
        assert all(m.timings.mask_ns == 0 or m.timings.batch_rows > 1 for m in got[3])


async def test_constrained_answer_from_the_prefix_cache(models: dict[str, Path], tmp_path: Path) -> None:
    model = models["deepseek_v3"]
    stops = list(TextTokenizer.from_dir(model).eos_token_ids)
    grammar = json_schema_grammar(fit_schema({"type": "array", "items": {"type": "integer"}}, 60))
    prompt = prompt_of(40, 9)
    async with cluster(model, tmp_path) as c:
        first = await collect(c.stub, request(prompt, 80, grammar=grammar, stop_token_ids=stops))
        second = await collect(c.stub, request(prompt, 80, grammar=grammar, stop_token_ids=stops, rid="again"))
    assert second[0].cached_prompt_tokens > 0 and first[0].cached_prompt_tokens == 0
    assert tokens(second) == tokens(first)
    assert isinstance(json.loads(_text(model, second)), list)


@pytest.mark.parametrize("grammar", ["", "start: /(unclosed/"])
async def test_bad_grammar_is_invalid_argument(models: dict[str, Path], tmp_path: Path, grammar: str) -> None:
    async with cluster(models["deepseek_v3"], tmp_path) as c:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(c.stub, request(prompt_of(5, 1), 4, grammar=grammar))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in (e.value.details() or "")
