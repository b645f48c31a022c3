"""The in-process engine's prefix cache (Engine.open(prefix_cache=...)): a prompt reuses every
cached token it shares but its last, the output equals an engine without the cache bit for bit,
and the cache persists in prefix_dir across engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from moetier.convert.synth import write_container
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# tiny-glm_moe_dsa: the DSA indexer keys are part of the cached, persisted KV; tiny-qwen3_next:
# the Gated DeltaNet state, resumable only where it was saved; tiny-gpt_oss: its sliding-window
# layers keep (and persist) their last positions only
HYBRID = "tiny-qwen3_next"


@pytest.fixture(scope="module", params=["tiny-deepseek_v3", "tiny-qwen3_moe", "tiny-glm_moe_dsa", HYBRID, "tiny-gpt_oss"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_container(request.param, tmp_path_factory.mktemp("engine-prefix") / request.param, 0)


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Engine]:
    with Engine.open(model, budget="100%") as e:
        yield e


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(7, 500, n)]


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    gen = engine.generate(prompt, params)
    return [g.token for g in gen], gen.cached_tokens


def test_reuse_to_the_token_changes_no_bit(model: Path, plain: Engine) -> None:
    base = ids(40, 1)
    with Engine.open(model, budget="100%", prefix_cache="64MiB") as e:
        out, cached = run(e, base)
        assert cached == 0 and out == run(plain, base)[0]
        # a fixed-size state resumes only at saved positions: each sequence's prompt less one token
        # and its end (base: 39 and 47; base[:17]: 16 and 23; base[:30]: 29 ...), the longest within
        # the shared prefix
        hybrid = model.name == HYBRID
        for prompt, want in ((base, 39), (base[:17], 0 if hybrid else 16), (base[:30], 16 if hybrid else 29),
                             (base[:31], 29 if hybrid else 30), (base[:33], 30 if hybrid else 32), (ids(20, 4), 0)):
            got, cached = run(e, prompt)
            assert cached == want, len(prompt)
            assert got == run(plain, prompt)[0], len(prompt)
        prompt = base
        for turn in range(3):  # a conversation: each turn resends all before it and adds a message
            prompt = [*prompt, *out, *ids(6, 2 + turn)]
            held = len(prompt) - 6 - 1  # the last turn's prompt and answer (its last token never fed)
            out, cached = run(e, prompt)
            assert cached == held and out == run(plain, prompt)[0], turn
        seeded = SamplingParams(temperature=0.8, max_tokens=6, seed=5, ignore_eos=True)
        assert run(e, base, seeded)[0] == run(plain, base, seeded)[0]


def test_persists_across_engines_and_keeps_an_early_stop(model: Path, plain: Engine, tmp_path: Path) -> None:
    base = ids(35, 10)
    with Engine.open(model, budget="100%", prefix_cache="64MiB", prefix_dir=tmp_path) as e:
        gen = e.generate(base, GREEDY)
        first = [next(gen).token for _ in range(3)]
        gen.close()  # the caller stopped after 3 tokens: the 37 positions fed so far are kept
    assert len(list(tmp_path.glob("*.kv"))) == 1
    with Engine.open(model, budget="100%", prefix_cache="64MiB", prefix_dir=tmp_path) as e:
        prompt = [*base, *first, *ids(4, 11)]
        got, cached = run(e, prompt)
        assert cached == len(base) + 2
        assert got == run(plain, prompt)[0]
        assert e.prefix is not None and e.prefix.stats().by_source["disk"] == cached
