"""A batch union larger than the RAM tier's budget is computed in waves (pin a wave, compute its
(row, slot) outputs, release, next wave; then the k-ordered combine), bit for bit what one shot
over the whole union computes: in the tier's wave planning, in the expert store, in the
in-process provider, and through the whole cluster against the in-process engine."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers_store import records
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_cluster_e2e import up
from test_expert_store import REC, batch, expected, running, store_settings

from moetier.errors import ResourceExhausted
from moetier.kernels.fast import FastOps
from moetier.model.ops import ReferenceOps
from moetier.model.sampling import SamplingParams
from moetier.rpc.errors import status_code
from moetier.rpc.tensors import from_pb
from moetier.store.provider import TieredExperts
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.container import Container
from services.expert_store.core import StoreCore

pytestmark = pytest.mark.timeout(60)

WAVE_BUDGET = 3 * REC  # three of the tiny model's records; one layer has 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moetier.convert import synth

    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("waves") / "tiny", 0)


class Residency(threading.Thread):
    """Samples the tier's resident + loading bytes (and recounts its bookkeeping) until stopped."""

    def __init__(self, tier: ExpertTier) -> None:
        super().__init__(daemon=True)
        self.tier = tier
        self.peak = 0
        self.samples = 0
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                s = self.tier.stats()
                self.peak = max(self.peak, s.resident_bytes + s.loading_bytes)
                self.tier.check_invariants()
                self.samples += 1
                time.sleep(0.0002)
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        if self.error is not None:
            raise self.error


# ---- the tier's wave plan ---------------------------------------------------------------------
def test_waves_fit_the_budget_and_put_present_experts_first(tmp_path: Path) -> None:
    sizes = {e: 4096 * (1 + e % 3) for e in range(12)}  # mixed record sizes: 4, 8 and 12 KiB
    index = records(tmp_path, n_experts=12, record_bytes=lambda k: sizes[k[1]])
    budget = 7 * 4096
    with ExpertTier.open(index, TierConfig(budget_bytes=budget), depth=2) as tier:
        assert tier.waves(1, [3, 1, 3, 0]) == [[0, 1, 3]]  # the union fits: one wave
        with tier.acquire(1, [9, 4]):
            pass  # now resident
        waves = tier.waves(1, np.arange(12).reshape(3, 4))
        assert sorted(e for w in waves for e in w) == list(range(12))
        assert waves[0][:2] == [4, 9]  # resident experts first, then the rest in id order
        assert all(sum(sizes[e] for e in w) <= budget for w in waves)
        # greedy: no wave could have taken the next wave's first expert
        assert all(sum(sizes[e] for e in w) + sizes[nxt[0]] > budget for w, nxt in itertools.pairwise(waves))
        misses = sum(tier.stats().misses.values())
        for w in waves:
            with tier.acquire(1, w):
                tier.check_invariants()
        assert sum(tier.stats().misses.values()) - misses == 10  # each expert read once, the two residents never


def test_in_process_provider_in_waves_equals_one_shot(model: Path) -> None:
    rng = np.random.default_rng(3)
    with Container.open(model) as c:
        big = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=c.expert_bytes), depth=2)
        small = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=WAVE_BUDGET), depth=2)
        ref = TieredExperts.open(c, ReferenceOps(), TierConfig(budget_bytes=WAVE_BUDGET), depth=2)
        try:
            for layer, (x, ids, w) in ((1, batch(rng, 16)), (2, batch(rng, 4, k=8)), (1, batch(rng, 9, k=3))):
                y = small.moe(layer, x, ids, w)
                assert np.array_equal(y, big.moe(layer, x, ids, w))
                assert np.array_equal(y, expected(model, layer, x, ids, w))
                dequantized = {int(e): c.read_expert(layer, int(e)) for e in np.unique(ids)}
                np.testing.assert_array_equal(ref.moe(layer, x, ids, w), ReferenceOps().moe(x, ids, w, dequantized))
                small.tier.check_invariants()
            assert big.waves == 3 and small.waves > 3
        finally:
            for p in (big, small, ref):
                p.close()


# ---- the expert store -------------------------------------------------------------------------
async def test_store_union_over_the_budget_equals_one_shot(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    cases = [(1, batch(rng, 16)),  # a prefill chunk: every expert of the layer
             (2, batch(rng, 3, k=8)),  # each row routes to more experts than the budget holds
             (1, batch(rng, 6, k=3)),
             (2, batch(rng, 5, ids=[[5, 5], [0, 7], [7, 0], [5, 5], [1, 2]])),  # duplicates in a row
             (1, batch(rng, 2, ids=[[1, 2], [2, 1]]))]  # fits: one wave
    with Container.open(model) as c:
        engine = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=c.expert_bytes), depth=2)
        async with running(store_settings(model, tmp_path / "big")) as big, \
                running(store_settings(model, tmp_path / "small", model={"expert_cache": str(WAVE_BUDGET)})) as st:
            sampler = Residency(st.core.tier)
            sampler.start()
            try:
                waves = {1: 0, 2: 0}
                for layer, (x, ids, w) in cases:
                    r = await st.compute(layer, x, ids, w)
                    y = from_pb(r.output, "output", dtype="float32", ndim=2)
                    one_shot = from_pb((await big.compute(layer, x, ids, w)).output, "output")
                    assert np.array_equal(y, one_shot), (layer, ids.shape)
                    assert np.array_equal(y, engine.moe(layer, x, ids, w))
                    assert np.array_equal(y, expected(model, layer, x, ids, w))
                    union = len(np.unique(ids))
                    assert r.hits + r.misses == union
                    waves[layer] += -(-union // 3)
                # concurrent calls, each in waves, share the budget and still give the one-shot bits
                many = [(layer, batch(rng, 12)) for layer in (1, 2, 1, 2)]
                got = await asyncio.gather(*(st.compute(layer, *b) for layer, b in many))
                for (layer, b), r in zip(many, got, strict=True):
                    assert np.array_equal(from_pb(r.output, "output"), expected(model, layer, *b))
                    waves[layer] += -(-len(np.unique(b[1])) // 3)
            finally:
                sampler.stop()
            assert sampler.samples > 10
            assert sampler.peak <= WAVE_BUDGET, sampler.peak
            for layer in (1, 2):
                assert st.metric("moetier_expert_store_compute_waves_total", layer=str(layer)) == waves[layer]
            for layer in (1, 2):  # the large budget: one wave per call
                calls = sum(1 for case in cases if case[0] == layer)
                assert big.metric("moetier_expert_store_compute_waves_total", layer=str(layer)) == calls
            assert st.metric("moetier_expert_store_compute_errors_total", code="resource_exhausted") == 0
        engine.close()


def test_one_expert_over_the_budget_is_resource_exhausted(model: Path, tmp_path: Path) -> None:
    settings = store_settings(model, tmp_path, model={"expert_cache": str(REC - 4096)})
    with pytest.raises(ResourceExhausted, match=f"budget of {REC - 4096} bytes holds no expert record "
                                                f"\\({REC} bytes each\\)") as info:
        StoreCore(settings)
    assert status_code(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- the cluster ------------------------------------------------------------------------------
async def test_cluster_at_the_default_budget_answers_a_long_prompt_as_the_engine(model: Path, tmp_path: Path) -> None:
    from moetier.engine import Engine

    prompt = np.random.default_rng(8).integers(7, 512, 64).tolist()
    # the default 25% budget: 4 of the 16 experts
    async with up(model, tmp_path, expert_cache="25%", inference={"expert_timeout_s": 5.0}) as cluster:
        client, store = cluster.client, cluster.store
        assert store.core.tier.budget == 4 * REC  # 25% of 16 records: a layer's union of 8 does not fit
        name = (await client.get("/v1/models")).json()["data"][0]["id"]
        r = await client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 12,
                                                       "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        text = generate_latest(store.core.metrics.registry).decode()
        totals = {name: sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                            if s.name == f"moetier_expert_store_compute_{name}_total") for name in ("calls", "waves")}
        assert totals["waves"] > totals["calls"] > 0  # the prefill's unions were computed in waves
    for budget in ("100%", "25%"):  # the in-process engine, one shot and in waves
        with Engine.open(model, budget=budget) as engine:
            eos = engine.eos_token_ids()
            params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=eos, ignore_eos=True)
            tokens = [g.token for g in engine.generate(prompt, params)]
            text = engine.tokenizer.decode(tokens)
        assert body["choices"][0]["text"] == text, budget
        assert body["usage"]["completion_tokens"] == len(tokens)
