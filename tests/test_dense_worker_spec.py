"""Speculative decoding in the dense worker (MTP drafts verified in the step), in process in
front of the real expert store: greedy output equal to the non-speculative engine alone and in a
batch of 8, logprobs, stops and limits, the prefix cache, a grammar checking drafted tokens,
seeded sampling, and the speculation metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_dense_worker import cluster, collect, prompt_of, reference, request, tokens

from moetier.convert import synth
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.text.grammar import json_schema_grammar

pytestmark = pytest.mark.timeout(180)
SPEC = {"inference": {"speculative_tokens": 3}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("spec-worker") / "m", 0)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    with Engine.open(model, budget="100%") as e:  # no speculation: the reference
        yield e


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def test_greedy_alone_and_batched_equal_plain_decoding(model: Path, engine: Engine, tmp_path: Path) -> None:
    prompts = [prompt_of(3 + (5 * i) % 37, 100 + i) for i in range(24)]
    want = [reference(engine, p, greedy(20)) for p in prompts]
    async with cluster(model, tmp_path, **SPEC) as c:
        for p, w in zip(prompts[:8], want[:8], strict=True):  # alone
            assert tokens(await collect(c.stub, request(p, 20))) == w
        for group in range(1, 3):  # batches of 8 of mixed lengths, chunked prefill beside verify steps
            batch = range(8 * group, 8 * group + 8)
            got = await asyncio.gather(*(collect(c.stub, request(prompts[i], 20, rid=f"r{i}"))
                                         for i in batch))
            assert [tokens(m) for m in got] == [want[i] for i in batch]
        m = c.metrics()
        drafted = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_drafted_tokens_total"))
        accepted = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_accepted_tokens_total"))
        assert 0 < accepted < drafted
        forwards, emitted = m["moetier_dense_worker_spec_forwards_total"], m["moetier_dense_worker_spec_emitted_tokens_total"]
        assert emitted == 24 * 19 and forwards < emitted  # the first token of each comes from its prefill
        assert m["moetier_dense_worker_spec_steps_total{mode=on,reason=none}"] > 0
        # acceptance per position: later positions are verified only after the earlier accepted
        d1 = m["moetier_dense_worker_spec_drafted_tokens_total{position=1}"]
        d2 = m["moetier_dense_worker_spec_drafted_tokens_total{position=2}"]
        assert d1 >= d2 and m["moetier_dense_worker_spec_accepted_tokens_total{position=1}"] >= d2


async def test_logprobs_stops_limits_and_penalties_equal_plain_decoding(model: Path, engine: Engine,
                                                                       tmp_path: Path) -> None:
    async with cluster(model, tmp_path, **SPEC) as c:
        for i in range(4):
            p = prompt_of(9 + i, 200 + i)
            stop = reference(engine, p, greedy(12))[5 + i]
            cases = [(greedy(14 + i, logprobs=True, top_logprobs=2), {"logprobs": True, "top_logprobs": 2}),
                     (greedy(30, stop_token_ids=(stop,)), {"stop_token_ids": [stop]}),
                     (greedy(1 + i), {}),
                     (greedy(18, frequency_penalty=0.6, presence_penalty=0.4),
                      {"frequency_penalty": 0.6, "presence_penalty": 0.4})]
            for params, extra in cases:
                msgs = await collect(c.stub, request(p, params.max_tokens, **extra))
                ref = list(engine.generate(p, params))
                assert tokens(msgs) == [g.token for g in ref], params
                assert msgs[-1].finish_reason == ref[-1].finish_reason
                if params.logprobs:  # (float32 on the wire)
                    got = [t for m in msgs for t in m.tokens]
                    assert [[x.token_id for x in t.top_logprobs] for t in got] == [
                        [i for i, _ in g.top_logprobs] for g in ref]
                    assert [t.logprob for t in got] == pytest.approx([g.logprob for g in ref], abs=1e-6)


async def test_prefix_cache_after_rejected_drafts(model: Path, engine: Engine, tmp_path: Path) -> None:
    """The KV a sequence leaves behind holds only accepted positions: the next turn, reusing it
    (in the same worker and after a restart), decodes what plain decoding does."""
    base = prompt_of(33, 300)
    async with cluster(model, tmp_path, **SPEC) as c:
        out = tokens(await collect(c.stub, request(base, 16)))
        assert out == reference(engine, base, greedy(16))
        turn = [*base, *out, *prompt_of(5, 301)]
        msgs = await collect(c.stub, request(turn, 16))
        assert msgs[0].cached_prompt_tokens == len(base) + len(out) - 1
        assert tokens(msgs) == reference(engine, turn, greedy(16))
        c.worker.core.prefix.close()
    async with cluster(model, tmp_path, **SPEC) as c:
        msgs = await collect(c.stub, request(turn, 16))
        assert msgs[0].cached_prompt_tokens > len(base) and tokens(msgs) == reference(engine, turn, greedy(16))


async def test_a_grammar_checks_the_drafted_tokens(model: Path, tmp_path: Path) -> None:
    """Structured output with drafts: exactly the tokens of the same grammar without speculation,
    every draft the grammar forbids rejected (drafts are masked too)."""
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string",
                                                                                               "maxLength": 12}},
                                   "required": ["n", "s"]})
    prompts = [prompt_of(7 + i, 400 + i) for i in range(4)]
    async with cluster(model, tmp_path / "plain", inference={"speculative_tokens": 0}) as c:
        plain = [tokens(await collect(c.stub, request(p, 40, grammar=grammar))) for p in prompts]
    async with cluster(model, tmp_path / "spec", **SPEC) as c:
        spec = [tokens(await collect(c.stub, request(p, 40, grammar=grammar))) for p in prompts]
        m = c.metrics()
        assert sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_drafted_tokens_total")) > 0
    assert spec == plain and all(plain)


async def test_sampling_seeded_and_not(model: Path, engine: Engine, tmp_path: Path) -> None:
    """A seeded request at temperature > 0 is not drafted for (which tokens a seed gives must not
    depend on the drafts the cost model chose): the plain engine's tokens, every time. Unseeded
    ones are drafted for and verified by rejection sampling."""
    p = prompt_of(10, 500)
    want = [g.token for g in engine.generate(p, SamplingParams(temperature=0.9, seed=5, max_tokens=20,
                                                                  ignore_eos=True))]
    async with cluster(model, tmp_path, **SPEC) as c:
        for _ in range(2):
            assert tokens(await collect(c.stub, request(p, 20, temperature=0.9, seed=5))) == want
        m = c.metrics()
        before = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_drafted_tokens_total"))
        assert before == 0
        for i in range(6):
            out = tokens(await collect(c.stub, request(prompt_of(10, 600 + i), 20, temperature=0.7)))
            assert len(out) == 20
        m = c.metrics()
        after = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_drafted_tokens_total"))
        assert after > before
