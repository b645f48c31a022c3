"""The expert store service, in-process on port 0 over the tiny synth container: the math
against the in-process engine and the numpy reference, single-flight, corruption with and
without a valid copy, a mirror removed under load, the budget, request validation, heat,
prefetch accounting, health, usage history and the documented metrics."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_store import Disk, corrupt, restore
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetier.convert import synth
from moetier.kernels.fast import FastOps
from moetier.model.ops import ReferenceOps
from moetier.rpc.errors import RETRY_AFTER_KEY
from moetier.rpc.tensors import from_pb, to_pb
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.settings import Settings, load_settings
from moetier.store.history import load_history
from moetier.store.provider import TieredExperts
from moetier.store.stats import HEAT_RAM
from moetier.store.tier import TierConfig
from moetier.weights.container import Container
from services.expert_store import metrics as metrics_module
from services.expert_store.core import COMPUTE_THREADS, ComputeBatch, StoreCore
from services.expert_store.server import GRPC_OPTIONS, SERVICE_NAME, StoreServer, create_server

pytestmark = pytest.mark.timeout(60)

D, E, LAYERS, TOP_K = 64, 8, (1, 2), 2  # the tiny-deepseek_v3 preset
REC = 8192  # its int4 expert record bytes
INVALID, DATA_LOSS, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED)


# ---- support (also used by test_expert_store_command.py) ------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("expert-store") / "tiny", 0)


def copy_model(model: Path, dest: Path) -> Path:
    """A private copy, for tests that damage files."""
    shutil.copytree(model, dest)
    return dest


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def store_settings(container: Path, data_dir: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "model": {"path": str(container), "expert_cache": "100%"},
        "cache": {"policy": "lru"},
        "storage": {"preload": False},  # a cold tier: these tests watch the demand reads
        "data_dir": str(data_dir),
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "store-t"},
    }
    return load_settings(overrides=_merge(base, over), environ={})


@dataclass
class Running:
    server: StoreServer
    core: StoreCore
    stub: pb_grpc.ExpertStoreStub
    channel: grpc.aio.Channel
    port: int

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Scraped samples: {sample name: {sorted labels: value}}."""
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for fam in text_string_to_metric_families(generate_latest(self.core.metrics.registry).decode()):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[name][tuple(sorted(labels.items()))]

    async def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                      step: int | None = None) -> pb.ComputeExpertsResponse:
        return await self.stub.ComputeExperts(compute_req(layer, x, ids, w, step), timeout=10)


@asynccontextmanager
async def running(settings: Settings, **kw: Any) -> AsyncIterator[Running]:
    server, port = create_server(settings, "127.0.0.1:0", **kw)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        yield Running(server, server.core, pb_grpc.ExpertStoreStub(channel), channel, port)
    finally:
        await channel.close()
        await server.stop(1)


def batch(rng: np.random.Generator, t: int, k: int = TOP_K, ids: Any = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, D] float32, ids [T, K] int32, weights [T, K] float32."""
    ids_a = rng.integers(0, E, (t, k)) if ids is None else np.asarray(ids)
    return (rng.standard_normal((ids_a.shape[0], D), dtype=np.float32), ids_a.astype(np.int32),
            rng.random(ids_a.shape, dtype=np.float32))


def compute_req(layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                step: int | None = None) -> pb.ComputeExpertsRequest:
    req = pb.ComputeExpertsRequest(layer=layer, hidden=to_pb(x), expert_ids=to_pb(ids), weights=to_pb(w))
    if step is not None:
        req.step = step
    return req


def expected(model: Path, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The engine's kernels over experts read straight from the (pristine) container."""
    with Container.open(model) as c:
        experts = {int(e): c.read_expert(layer, int(e)) for e in np.unique(ids)}
        return FastOps(threads=1).moe(x, ids, w, experts)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# ---- preload -----------------------------------------------------------------------------------
async def test_a_budget_that_holds_every_expert_is_filled_before_ready(model: Path, tmp_path: Path) -> None:
    """storage.preload (the default): a store whose budget holds all its experts reads them at start,
    so the first calls read nothing and give the cold store's bits; a smaller budget fills on demand,
    and so does a store with preload off."""
    rng = np.random.default_rng(4)
    x, ids, w = batch(rng, 9)
    with Container.open(model) as c:
        total, n_experts = c.expert_bytes, len(c.index.records)
    outs = {}
    for name, over in (("preloaded", {"storage": {"preload": True}}), ("cold", {}),
                       ("half", {"storage": {"preload": True}, "model": {"expert_cache": str(total // 2)}})):
        async with running(store_settings(model, tmp_path / name, **over)) as st:
            s = st.core.tier.stats()
            if name == "preloaded":
                assert (s.resident_experts, s.resident_bytes, s.loading_experts) == (n_experts, total, 0)
            else:
                assert s.resident_experts == 0
            r = await st.compute(1, x, ids, w)
            assert (r.misses == 0) == (name == "preloaded"), (name, r.hits, r.misses)
            assert r.hits + r.misses == len(np.unique(ids))
            s = st.core.tier.stats()
            assert sum(s.misses.values()) == r.misses and s.prefetch_issued == 0  # preload is neither
            outs[name] = from_pb(r.output, "output", dtype="float32", ndim=2)
    assert np.array_equal(outs["preloaded"], outs["cold"]) and np.array_equal(outs["half"], outs["cold"])


# ---- the math ---------------------------------------------------------------------------------
async def test_compute_equals_in_process_engine_and_reference(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    cases = [(1, batch(rng, 1)), (2, batch(rng, 7)), (1, batch(rng, 33, k=3)),  # K need not be top-k
             (2, batch(rng, 4, ids=[[5, 5], [0, 7], [7, 0], [5, 5]])), (1, batch(rng, 5, k=1))]
    ref = ReferenceOps()
    with Container.open(model) as c:
        engine = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=c.expert_bytes), depth=2)
        async with running(store_settings(model, tmp_path)) as st:
            for step, (layer, (x, ids, w)) in enumerate(cases):
                r = await st.compute(layer, x, ids, w, step=step)
                y = from_pb(r.output, "output", dtype="float32", ndim=2)
                assert np.array_equal(y, engine.moe(layer, x, ids, w)), (layer, ids.shape)
                dequantized = {int(e): c.read_expert(layer, int(e)) for e in np.unique(ids)}
                np.testing.assert_allclose(y, ref.moe(x, ids, w, dequantized), rtol=2e-4, atol=2e-5)
                assert r.hits + r.misses == len(np.unique(ids))
                assert r.load_ns > 0 and r.compute_ns > 0
            used = {layer: set() for layer in LAYERS}
            for layer, (_, ids, _) in cases:
                used[layer] |= set(ids.ravel().tolist())
            assert st.core.tier.stats().misses == {layer: len(u) for layer, u in used.items()}  # each read once
            assert st.metric("moetier_expert_store_compute_calls_total", layer="1") == 3
            assert st.metric("moetier_expert_store_compute_rows_total", layer="1") == 1 + 33 + 5
        engine.close()


async def test_single_flight_sixteen_calls_one_read(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x, ids, w = batch(rng, 3, ids=[[6, 6], [6, 6], [6, 6]])
    async with running(store_settings(model, tmp_path)) as st:
        disk = Disk(st.core.tier.engine, hold=True)  # the first read waits at the gate
        calls = [asyncio.ensure_future(st.compute(2, x, ids, w)) for _ in range(16)]
        await asyncio.to_thread(disk.wait_active, 1)
        busy = min(16, COMPUTE_THREADS)  # the calls on a compute thread; the others queue for one
        for _ in range(500):  # until every running call joined the one read in flight
            if st.core.tier.stats().misses[2] == busy:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert st.core.tier.stats().misses[2] == busy  # no call pinned twice, none read again
        disk.gate.set()
        results = await asyncio.gather(*calls)
        io = st.core.tier.stats().io
        assert io is not None and (io.submitted, io.reads, disk.reads()) == (1, 1, 1)
        # those that waited for the read joined it; those queued behind them found the expert in RAM
        assert sorted((r.hits, r.misses) for r in results) == [(0, 1)] * busy + [(1, 0)] * (16 - busy)
        want = expected(model, 2, x, ids, w)
        for r in results:
            assert np.array_equal(from_pb(r.output, "output"), want)


# ---- corruption and mirrors -------------------------------------------------------------------
async def test_corrupt_primary_is_served_from_a_valid_mirror(model: Path, tmp_path: Path) -> None:
    m = copy_model(model, tmp_path / "m")
    shutil.copytree(m / "experts", tmp_path / "mirror")
    rng = np.random.default_rng(3)
    x, ids, w = batch(rng, 2, ids=[[3, 1], [3, 4]])
    # the primary weighs a million times the mirror: every first read goes to the primary
    settings = store_settings(m, tmp_path, storage={"mirrors": [str(tmp_path / "mirror")],
                                                    "mirror_weights": [1e6, 1e-6]})
    async with running(settings) as st:
        corrupt(m / "experts", st.core.tier.index.records[(1, 3)])
        r = await st.compute(1, x, ids, w)
        assert np.array_equal(from_pb(r.output, "output"), expected(model, 1, x, ids, w))
        io = st.core.tier.stats().io
        assert io is not None and (io.checksum_failures, io.fallbacks, io.corrupt) == (1, 1, 0)
        assert st.metric("moetier_expert_store_checksum_failures_total") == 1
        assert st.metric("moetier_expert_store_disk_checksum_failures_total", disk="primary") == 1
        assert st.metric("moetier_expert_store_disk_checksum_failures_total", disk="mirror0") == 0
        assert st.metric("moetier_expert_store_disk_reads_total", disk="mirror0") == 1


async def test_corrupt_without_valid_copy_is_data_loss_and_the_rest_is_served(
        model: Path, tmp_path: Path) -> None:
    m = copy_model(model, tmp_path / "m")
    rng = np.random.default_rng(4)
    async with running(store_settings(m, tmp_path, model={"expert_cache": str(6 * REC)})) as st:
        loc = st.core.tier.index.records[(1, 2)]
        original = corrupt(m / "experts", loc)
        bad = batch(rng, 2, ids=[[0, 2], [1, 0]])
        for attempt in range(2):  # nothing of the failure is remembered: the second call reads again
            err = await rpc_error(st.compute(1, *bad))
            assert err.code() == DATA_LOSS
            assert "layer 1 expert 2" in err.details() and "layer-001.bin" in err.details()
            assert f"offset {loc.offset}" in err.details() and "checksum" in err.details()
            for layer in LAYERS:  # every other expert keeps being served
                x, ids, w = batch(rng, 3, ids=rng.choice([e for e in range(E) if (layer, e) != (1, 2)], (3, 2)))
                r = await st.compute(layer, x, ids, w)
                assert np.array_equal(from_pb(r.output, "output"), expected(model, layer, x, ids, w)), attempt
        assert st.metric("moetier_expert_store_compute_errors_total", code="data_loss") == 2
        assert st.metric("moetier_expert_store_corrupt_records_total") == 2
        st.core.tier.check_invariants()
        restore(m / "experts", loc, original)  # repaired on disk: served again
        r = await st.compute(1, *bad)
        assert np.array_equal(from_pb(r.output, "output"), expected(model, 1, *bad))


async def test_mirror_removed_mid_run_fails_no_request(model: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    shutil.copytree(model, mirror)
    settings = store_settings(model, tmp_path, model={"expert_cache": str(6 * REC)},
                              storage={"mirrors": [str(mirror)], "mirror_weights": [1.0, 1.0]})
    async with running(settings) as st:
        info = await st.stub.Info(pb.InfoRequest(), timeout=2)
        assert [(d.name, d.state) for d in info.disks] == [("primary", "ok"), ("mirror0", "ok")]
        tiers = from_pb((await st.stub.Heat(pb.HeatRequest(), timeout=2)).tier, "tier")
        assert {1, 2} <= set(np.unique(tiers).tolist())  # experts placed on both copies
        stop = asyncio.Event()
        done: list[int] = []

        async def caller(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                layer = int(rng.choice(LAYERS))
                x, ids, w = batch(rng, 1)
                r = await st.compute(layer, x, ids, w)  # any failure fails the test
                assert np.array_equal(from_pb(r.output, "output"), expected(model, layer, x, ids, w))
                done.append(layer)

        callers = [asyncio.ensure_future(caller(i)) for i in range(3)]
        # the mirror in use before it goes: wait for its first reads (however slow the machine)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (reads_before := st.core.tier.stats().io.disks[1].reads) == 0:  # type: ignore[union-attr]
            assert loop.time() < deadline, "no read reached the mirror in 60 s"
            await asyncio.sleep(0.02)
        shutil.rmtree(mirror)
        n = len(done)
        while len(done) < n + 30:
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*callers)
        info = await st.stub.Info(pb.InfoRequest(), timeout=2)
        assert [(d.name, d.state) for d in info.disks] == [("primary", "ok"), ("mirror0", "degraded")]
        assert reads_before > 0
        assert st.metric("moetier_expert_store_disk_ok", disk="mirror0") == 0
        assert st.metric("moetier_expert_store_disk_ok", disk="primary") == 1
        tiers = from_pb((await st.stub.Heat(pb.HeatRequest(), timeout=2)).tier, "tier")
        assert set(np.unique(tiers).tolist()) <= {0, 1}  # nothing is placed on the degraded mirror


# ---- the budget -------------------------------------------------------------------------------
async def test_resident_bytes_never_exceed_the_budget(model: Path, tmp_path: Path) -> None:
    budget = 5 * REC
    rng = np.random.default_rng(5)
    pick = random.Random(5)
    async with running(store_settings(model, tmp_path, model={"expert_cache": str(budget)},
                                      cache={"policy": "lfu"})) as st:
        for _ in range(40):
            reqs = [(pick.choice(LAYERS), batch(rng, pick.randint(1, 3))) for _ in range(pick.randint(1, 3))]
            results = await asyncio.gather(*(st.compute(layer, *b) for layer, b in reqs), return_exceptions=True)
            for (layer, b), r in zip(reqs, results, strict=True):
                if isinstance(r, grpc.aio.AioRpcError):  # other calls' pins left no room for pin_wait_s
                    assert r.code() == EXHAUSTED and "budget of 40960 bytes" in r.details(), r.details()
                else:
                    assert isinstance(r, pb.ComputeExpertsResponse)
                    assert np.array_equal(from_pb(r.output, "output"), expected(model, layer, *b))
            st.core.tier.check_invariants()
            heat = await st.stub.Heat(pb.HeatRequest(), timeout=2)
            assert heat.resident_bytes <= heat.budget_bytes == budget
            assert st.metric("moetier_expert_store_resident_bytes") <= budget
        assert st.core.tier.stats().evictions > 0


async def test_no_room_left_by_pinned_computes_is_resource_exhausted_with_the_numbers(
        model: Path, tmp_path: Path) -> None:
    """A union larger than the budget is computed in waves (test_expert_store_waves.py); what is
    refused is a wave that finds the budget pinned by running computes for pin_wait_s."""
    async with running(store_settings(model, tmp_path, model={"expert_cache": str(5 * REC)})) as st:
        held = await asyncio.to_thread(st.core.tier.pin, 1, [4, 5, 6, 7])  # a running compute's pins
        try:
            x, ids, w = batch(np.random.default_rng(6), 3, ids=[[0, 1], [2, 3], [3, 0]])
            err = await rpc_error(st.compute(1, x, ids, w))
        finally:
            held.release()
        assert err.code() == EXHAUSTED
        assert "budget of 40960 bytes exhausted: 32768 bytes pinned by running computes" in err.details()
        assert "layer 1 needs 32768 more bytes for 4 experts" in err.details()
        assert any(k == RETRY_AFTER_KEY for k, _ in err.trailing_metadata() or ())
        assert st.metric("moetier_expert_store_compute_errors_total", code="resource_exhausted") == 1
        r = await st.compute(1, x, ids, w)  # the pins gone, the same call is served
        assert np.array_equal(from_pb(r.output, "output"), expected(model, 1, x, ids, w))


# ---- validation -------------------------------------------------------------------------------
def _ok() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return batch(np.random.default_rng(7), 2)


def _bad_compute(case: str) -> pb.ComputeExpertsRequest:
    x, ids, w = _ok()
    if case == "dense layer":
        return compute_req(0, x, ids, w)
    if case == "layer past the end":
        return compute_req(9, x, ids, w)
    if case == "expert id too large":
        ids[1, 1] = E
    elif case == "negative expert id":
        ids[0, 0] = -1
    elif case == "hidden float16":
        return pb.ComputeExpertsRequest(layer=1, hidden=to_pb(x.astype(np.float16)), expert_ids=to_pb(ids),
                                        weights=to_pb(w))
    elif case == "ids float32":
        return pb.ComputeExpertsRequest(layer=1, hidden=to_pb(x), expert_ids=to_pb(ids.astype(np.float32)),
                                        weights=to_pb(w))
    elif case == "weights int32":
        return pb.ComputeExpertsRequest(layer=1, hidden=to_pb(x), expert_ids=to_pb(ids),
                                        weights=to_pb(w.astype(np.int32)))
    elif case == "wrong byte count":
        req = compute_req(1, x, ids, w)
        req.hidden.data = req.hidden.data[:-4]
        return req
    elif case == "missing hidden":
        return pb.ComputeExpertsRequest(layer=1, expert_ids=to_pb(ids), weights=to_pb(w))
    elif case == "1-D hidden":
        x = x.reshape(-1)
    elif case == "K mismatch":
        w = np.ones((2, 3), np.float32)
    elif case == "K = 0":
        ids, w = np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32)
    elif case == "hidden width":
        x = np.zeros((2, D - 1), np.float32)
    elif case == "T mismatch":
        x = np.zeros((3, D), np.float32)
    elif case == "empty batch":
        x, ids, w = np.zeros((0, D), np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32)
    elif case == "NaN in hidden":
        x[1, 5] = np.nan
    elif case == "inf in weights":
        w[0, 1] = np.inf
    return compute_req(1, x, ids, w)


BAD_COMPUTE = {
    "dense layer": r"layer 0 is not a MoE layer of this model \(MoE layers: 1, 2\)",
    "layer past the end": r"layer 9 is not a MoE layer",
    "expert id too large": r"expert_ids: expert id 8 at \[1, 1\] is outside \[0, 8\)",
    "negative expert id": r"expert_ids: expert id -1 at \[0, 0\] is outside \[0, 8\)",
    "hidden float16": r"hidden: dtype float16 where float32 is required",
    "ids float32": r"expert_ids: dtype float32 where int32 is required",
    "weights int32": r"weights: dtype int32 where float32 is required",
    "wrong byte count": r"hidden: 508 bytes for shape \[2, 64\] float32 \(expected 512\)",
    "missing hidden": r"hidden: missing tensor",
    "1-D hidden": r"hidden: 1-D tensor of shape \[128\] where 2-D is required",
    "K mismatch": r"K mismatch: expert_ids \[2, 2\] and weights \[2, 3\]",
    "K = 0": r"K = 0 experts per row",
    "hidden width": r"hidden: rows of width 63, the model's hidden size is 64",
    "T mismatch": r"row count mismatch: hidden has 3 rows, expert_ids 2, weights 2",
    "empty batch": r"empty batch \(T = 0 rows\)",
    "NaN in hidden": r"hidden: non-finite value nan at \[1, 5\]",
    "inf in weights": r"weights: non-finite value inf at \[0, 1\]",
}


async def test_bad_requests_are_invalid_argument(model: Path, tmp_path: Path) -> None:
    async with running(store_settings(model, tmp_path)) as st:
        for case, message in BAD_COMPUTE.items():
            err = await rpc_error(st.stub.ComputeExperts(_bad_compute(case), timeout=5))
            assert err.code() == INVALID, case
            assert re.search(message, err.details()), (case, err.details())
        for req, message in ((pb.PrefetchRequest(layer=0, expert_ids=[1]), "layer 0 is not a MoE layer"),
                             (pb.PrefetchRequest(layer=1, expert_ids=[1, 8]), r"expert id 8 at \[1\]")):
            err = await rpc_error(st.stub.Prefetch(req, timeout=5))
            assert err.code() == INVALID and re.search(message, err.details()), err.details()
        assert st.metric("moetier_expert_store_compute_errors_total", code="invalid_argument") == len(BAD_COMPUTE)
        r = await st.compute(1, *_ok())  # nothing happened to the store
        assert r.misses == len(np.unique(_ok()[1]))
        assert st.core.tier.stats().failed_loads == 0


# ---- info, heat, prefetch, health ------------------------------------------------------------
async def test_info_and_health(model: Path, tmp_path: Path) -> None:
    async with running(store_settings(model, tmp_path, model={"expert_cache": "50%"})) as st:
        info = await st.stub.Info(pb.InfoRequest(), timeout=2)
        with Container.open(model) as c:
            assert info.model_id == c.index.identity
        assert (info.arch, info.hidden_size, list(info.moe_layers), info.n_experts, info.top_k) == (
            "deepseek_v3", D, list(LAYERS), E, TOP_K)
        assert (info.record_bytes, info.budget_bytes, info.policy, info.expert_dtype, info.store_id) == (
            REC, 8 * REC, "lru", "int4", "store-t")
        assert [(d.name, d.path, d.state, d.files) for d in info.disks] == [
            ("primary", str(model / "experts"), "ok", 2)]
        health = health_pb2_grpc.HealthStub(st.channel)
        for service in ("", SERVICE_NAME):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


async def test_heat_after_traffic(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    async with running(store_settings(model, tmp_path)) as st:
        await st.compute(1, *batch(rng, 2, ids=[[0, 1], [1, 2]]), step=1)
        await st.compute(2, *batch(rng, 1, ids=[[3, 3]]), step=1)
        await st.compute(1, *batch(rng, 1, ids=[[4, 5]]), step=3)
        h = await st.stub.Heat(pb.HeatRequest(), timeout=2)
        assert (list(h.moe_layers), h.n_experts, list(h.disks), h.step) == ([1, 2], E, ["primary"], 3)
        counts = from_pb(h.counts, "counts", dtype="uint32", ndim=2)
        tier = from_pb(h.tier, "tier", dtype="uint8", ndim=2)
        recent = from_pb(h.recent, "recent", dtype="uint8", ndim=2)
        assert counts.tolist() == [[1, 2, 1, 0, 1, 1, 0, 0], [0, 0, 0, 2, 0, 0, 0, 0]]
        assert recent.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0]]
        assert tier.tolist() == [[0, 0, 0, 1, 0, 0, 1, 1], [1, 1, 1, 0, 1, 1, 1, 1]]
        assert (h.resident_bytes, h.budget_bytes) == (6 * REC, 16 * REC)


async def test_prefetch_then_compute_counts_as_useful(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    async with running(store_settings(model, tmp_path)) as st:
        r = await st.stub.Prefetch(pb.PrefetchRequest(layer=2, expert_ids=[4, 6], step=1), timeout=2)
        assert (r.queued, r.resident, r.dropped) == (2, 0, 0)
        for _ in range(500):
            if st.core.tier.stats().loading_experts == 0:
                break
            await asyncio.sleep(0.01)
        c = await st.compute(2, *batch(rng, 2, ids=[[4, 6], [6, 4]]), step=1)
        assert (c.hits, c.misses) == (2, 0)
        assert st.core.tier.stats().prefetch_useful_by_layer == {1: 0, 2: 2}
        assert st.metric("moetier_expert_store_prefetch_useful_total", layer="2") == 2
        assert st.metric("moetier_expert_store_prefetch_queued_total") == 2
        r = await st.stub.Prefetch(pb.PrefetchRequest(layer=2, expert_ids=[4, 5], step=2), timeout=2)
        assert (r.queued, r.resident, r.dropped) == (1, 1, 0)
        for _ in range(500):  # let expert 5's read finish: a hint still queued at step 5 would be stale
            heat = st.core.tier.heat()
            if heat.state[list(heat.layers).index(2), 5] == HEAT_RAM:
                break
            await asyncio.sleep(0.01)
        await st.compute(1, *batch(rng, 1), step=5)
        r = await st.stub.Prefetch(pb.PrefetchRequest(layer=1, expert_ids=[7], step=4), timeout=2)
        assert (r.queued, r.resident, r.dropped) == (0, 0, 1)  # older than the latest step: stale
        assert st.metric("moetier_expert_store_prefetch_dropped_total") == 1
    async with running(store_settings(model, tmp_path, storage={"prefetch": False})) as st:
        r = await st.stub.Prefetch(pb.PrefetchRequest(layer=1, expert_ids=[1, 2, 2]), timeout=2)
        assert (r.queued, r.resident, r.dropped) == (0, 0, 2)


async def test_cancelled_call_leaves_nothing_pinned(model: Path, tmp_path: Path) -> None:
    async with running(store_settings(model, tmp_path)) as st:
        disk = Disk(st.core.tier.engine, hold=True)
        x, ids, w = batch(np.random.default_rng(10), 2)
        err = await rpc_error(st.stub.ComputeExperts(compute_req(1, x, ids, w), timeout=0.3))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        disk.gate.set()
        for _ in range(500):
            s = st.core.tier.stats()
            if s.loading_experts == 0 and s.pinned_experts == 0:
                break
            await asyncio.sleep(0.01)
        assert (s.loading_experts, s.pinned_experts) == (0, 0)
        st.core.tier.check_invariants()
        r = await st.compute(1, x, ids, w)
        assert r.hits == len(np.unique(ids))  # the cancelled call's reads completed and stayed


async def test_learned_history_saved_periodically_and_on_stop(model: Path, tmp_path: Path) -> None:
    settings = store_settings(model, tmp_path, cache={"policy": "learned"})
    path = tmp_path / "history" / "store-t.hist"
    async with running(settings, history_interval_s=0.05) as st:
        assert st.core.tier.config.history_path == path
        await st.compute(2, *batch(np.random.default_rng(11), 1, ids=[[1, 3]]))
        for _ in range(200):
            if path.exists():
                break
            await asyncio.sleep(0.02)
        assert path.exists()
        await st.compute(2, *batch(np.random.default_rng(12), 1, ids=[[1, 1]]))
    with Container.open(model) as c:
        counts = load_history(path, LAYERS, E, c.index.identity)
    assert counts is not None and counts[1, 1] > counts[1, 3] > 0 and counts[0].sum() == 0


# ---- metrics ----------------------------------------------------------------------------------
def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| (moetier_expert_store_\w+) \|", metrics_module.__doc__ or "", re.M))


async def test_metrics_are_documented_and_exposed(model: Path, tmp_path: Path) -> None:
    documented = documented_metrics()
    assert len(documented) >= 30
    mirror = tmp_path / "mirror"
    shutil.copytree(model, mirror)
    async with running(store_settings(model, tmp_path, storage={"mirrors": [str(mirror)]})) as st:
        await st.compute(1, *batch(np.random.default_rng(13), 4))
        text = generate_latest(st.core.metrics.registry).decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        exposed = {f"{n}_total" if f.type == "counter" else n for n, f in families.items()
                   if not n.endswith("_created")}  # prometheus_client's creation timestamps
        assert exposed == documented
        for name in exposed:
            assert re.search(r"_(total|bytes|seconds|experts|info|in_flight|queued|ok|weight)$", name), name
            labels = {k for s in families[name.removesuffix("_total")].samples for k in s.labels} - {"le"}
            assert labels <= {"layer", "disk", "policy", "code"}, (name, labels)
        assert st.metric("moetier_expert_store_policy_info", policy="lru") == 1
        assert st.metric("moetier_expert_store_budget_bytes") == 16 * REC
        assert st.metric("moetier_expert_store_disk_ok", disk="mirror0") == 1
        assert st.metric("moetier_expert_store_compute_seconds_count") == 1
        s = st.core.tier.stats()
        assert s.io is not None
        assert sum(st.metric("moetier_expert_store_disk_reads_total", disk=d) for d in ("primary", "mirror0")) == \
            s.io.reads
        assert st.metric("moetier_expert_store_disk_read_seconds_count", disk="primary") == s.io.disks[0].reads
        assert st.metric("moetier_expert_store_misses_total", layer="1") == s.misses[1] > 0


async def test_compute_cancelled_while_waiting_for_room_pins_nothing(model: Path, tmp_path: Path) -> None:
    """The store's compute path: a call cancelled while it waits (on the compute thread) for
    other computes to unpin leaves nothing pinned once the room it waited for comes."""
    async with running(store_settings(model, tmp_path, model={"expert_cache": str(2 * REC)})) as st:
        tier = st.core.tier
        held = await asyncio.to_thread(tier.pin, 1, [0, 1])
        x, ids, w = batch(np.random.default_rng(15), 1, ids=[[2]])
        waiting = asyncio.ensure_future(st.core.compute(ComputeBatch(1, x, ids, w)))
        await asyncio.sleep(0.2)  # it waits for room off the event loop (up to pin_wait_s, 1 s)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        held.release()  # the room comes: the abandoned wait commits its experts and reads them
        for _ in range(300):
            if (1, 2) in tier.resident():
                break
            await asyncio.sleep(0.01)
        assert (1, 2) in tier.resident()
        await asyncio.sleep(0.05)
        assert (tier.stats().pinned_experts, tier.stats().loading_experts) == (0, 0)
        tier.check_invariants()


@pytest.mark.parametrize("lane", [False, True], ids=["grpc", "local-lane"])
async def test_dense_worker_provider_over_the_store_equals_the_in_process_engine(model: Path, tmp_path: Path,
                                                                                  lane: bool) -> None:
    """The contract end to end: the dense worker's RemoteExperts against this server, over gRPC
    and over the local lane."""
    from services.dense_worker.remote import RemoteExperts

    rng = np.random.default_rng(14)
    with Container.open(model) as c:
        engine = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=c.expert_bytes), depth=2)
        async with running(store_settings(model, tmp_path)) as st:
            remote = RemoteExperts(f"127.0.0.1:{st.port}", c.index.identity, timeout_s=10, hidden_size=D,
                                   local_lane=lane)
            try:
                # 1 row: the store computes on its event loop's thread; 5 rows: on its compute thread.
                # moe_start: the call made by the provider's caller thread while this one waits.
                for rows in (5, 1):
                    for layer in (*LAYERS, *LAYERS):
                        remote.new_step()
                        x, ids, w = batch(rng, rows)
                        want = engine.moe(layer, x, ids, w)
                        assert np.array_equal(await asyncio.to_thread(remote.moe, layer, x, ids, w), want)
                        call = remote.moe_start(layer, x, ids, w)
                        assert np.array_equal(await asyncio.to_thread(call.result), want)
                assert remote.stats.calls == 16 and remote.stats.failed_calls == 0 and remote.stats.call_s > 0
                assert (remote._lane is not None) == lane
                assert (await st.stub.Heat(pb.HeatRequest(), timeout=2)).step == 8
                remote.moe_start(LAYERS[0], x, ids, w).abandon()  # nobody waits: dropped, the provider goes on
                assert np.array_equal(await asyncio.to_thread(remote.moe, LAYERS[0], x, ids, w),
                                      engine.moe(LAYERS[0], x, ids, w))
            finally:
                remote.close()
        engine.close()
