"""Speculative decoding through a running `moetier up` (router, dense worker, expert store and
gateway in processes of their own, HTTP in front): a tiny container with an MTP head, drafting on
(the worker's default), its greedy output equal to the in-process engine's plain decoding for 104
prompts sent one at a time and again in batches of 8, with drafts both accepted and rejected."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers_up import Up, metrics, moetier_up, write_config

from moetier.convert import synth
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.text.tokenizer import TextTokenizer

pytestmark = pytest.mark.timeout(300)

PROMPTS = 104  # >= 100, 13 batches of 8
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("up-spec") / "m", 0)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    config, ports = write_config(tmp_path_factory.mktemp("up-spec-cluster"),
                                 {"model": {"path": str(model)}, "inference": {"speculative_tokens": 3}})
    with moetier_up(config, ports) as up:
        up.wait_up(180)
        yield up


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(12)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(PROMPTS)]


def test_greedy_speculative_output_equals_plain_decoding_alone_and_in_batches_of_8(cluster: Up, model: Path) -> None:
    tok = TextTokenizer.from_dir(model)
    ps = prompts(tok.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, stop_token_ids=tuple(tok.eos_token_ids),
                            ignore_eos=True)  # the eos ids are the stop ids, as the gateway sends them
    with Engine.open(model, budget="100%") as engine:  # no drafts: the reference
        want = [tok.decode([g.token for g in engine.generate(p, params)]) for p in ps]
    assert len(set(want)) > PROMPTS // 2  # the prompts lead to different outputs

    name = cluster_model(cluster)

    def body(p: list[int]) -> dict[str, object]:
        return {"model": name, "prompt": p, "temperature": 0, "max_tokens": TOKENS}

    async def one(client: httpx.AsyncClient, p: list[int]) -> str:
        r = await client.post("/v1/completions", json=body(p))
        assert r.status_code == 200, r.text
        text: str = r.json()["choices"][0]["text"]
        return text

    async def drive() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            alone = [await one(client, p) for p in ps]
            batched: list[str] = []
            for i in range(0, PROMPTS, 8):
                batched += await asyncio.gather(*(one(client, p) for p in ps[i : i + 8]))
        return alone, batched

    alone, batched = asyncio.run(drive())
    assert [i for i, (a, w) in enumerate(zip(alone, want, strict=True)) if a != w] == []
    assert [i for i, (b, w) in enumerate(zip(batched, want, strict=True)) if b != w] == []
    m = metrics(f"http://127.0.0.1:{cluster.ports['dense_worker_metrics']}/metrics")
    drafted = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_drafted_tokens_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("moetier_dense_worker_spec_accepted_tokens_total"))
    assert 0 < accepted < drafted  # drafts were made, most kept, some rejected: both paths ran
    assert m["moetier_dense_worker_spec_forwards_total"] < m["moetier_dense_worker_spec_emitted_tokens_total"]


def cluster_model(cluster: Up) -> str:
    r = httpx.get(f"{cluster.url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    name: str = r.json()["data"][0]["id"]
    return name
