"""The architectures added after the first seven, served by a running `moetier up` (router, dense
worker and expert store in processes of their own, the gateway in front) through the OpenAI
API at temperature 0: every completion equals the in-process engine's tokens on the same
container, prompts sent one at a time and as a batch."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
from helpers_up import moetier_up, write_config

from moetier.convert import synth
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.text.tokenizer import TextTokenizer

pytestmark = pytest.mark.timeout(300)

ARCHS = ["minimax_m2", "qwen3_next", "qwen3_5_moe", "kimi_k25", "gpt_oss"]
# gpt-oss: prompts past its window (8, the KV keeping 8 + 16 positions), so the sliding layers'
# caches slide in the dense worker
LONGEST = {"gpt_oss": 70}
PROMPTS = 8
TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_served_through_the_openai_api_equals_the_engine(arch: str, tmp_path: Path) -> None:
    model = synth.write_container(f"tiny-{arch}", tmp_path / "m", 0)
    tok = TextTokenizer.from_dir(model)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(3, LONGEST.get(arch, 30)))]
               for _ in range(PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, stop_token_ids=tuple(tok.eos_token_ids),
                            ignore_eos=True)  # the eos ids are the stop ids, as the gateway sends them
    with Engine.open(model, budget="100%") as engine:
        want = [tok.decode([g.token for g in engine.generate(p, params)]) for p in prompts]
    assert len(set(want)) > 1
    config, ports = write_config(tmp_path / "cluster", {"model": {"path": str(model)}})
    with moetier_up(config, ports) as up:
        up.wait_up(180)

        async def drive() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(base_url=up.url, timeout=120) as client:
                name = (await client.get("/v1/models")).json()["data"][0]["id"]

                async def one(p: list[int]) -> str:
                    r = await client.post("/v1/completions", json={"model": name, "prompt": p, "temperature": 0,
                                                                   "max_tokens": TOKENS})
                    assert r.status_code == 200, r.text
                    text: str = r.json()["choices"][0]["text"]
                    return text

                alone = [await one(p) for p in prompts]
                batch = list(await asyncio.gather(*(one(p) for p in prompts)))
            return alone, batch

        alone, batch = asyncio.run(drive())
    assert alone == want
    assert batch == want
