"""Shared experts (storage.share, inference.shared_experts): an expert store whose RAM tier holds
every expert it serves reads them into one shared memory at start and offers it on its local
lane; a dense worker on the same host maps it and computes its calls there, with its own
kernels. The answers are the store's bits, the store still counts the calls (heat, hits, calls
per layer), a store that goes away is noticed at the next call, and either setting turns it off."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from moetier.convert import synth
from moetier.errors import Unavailable
from moetier.kernels import FastOps
from moetier.model.ops import DoneCall
from moetier.model.router import routing_weights
from moetier.settings import load_settings
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.container import Container
from moetier.weights.quant import quantize
from services.dense_worker.remote import RemoteExperts, SharedCompute
from services.expert_store.server import StoreServer, create_server

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the local lane is Linux-only")]

D, E, K = 64, 8, 2  # tiny-deepseek_v3
LAYERS = (1, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("shared") / "tiny", 0)


@asynccontextmanager
async def store(model: Path, tmp_path: Path, **storage: Any) -> AsyncIterator[tuple[StoreServer, int]]:
    settings = load_settings(overrides={
        "model": {"path": str(model), "expert_cache": "100%"}, "cache": {"policy": "lru"},
        "storage": {"preload": True, **storage}, "data_dir": str(tmp_path / "data"),
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0}}, environ={})
    server, port = create_server(settings, "127.0.0.1:0", threads=1)
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(0)


def worker_side(model: Path, port: int, shared: bool = True) -> RemoteExperts:
    with Container.open(model) as c:
        model_id, parse = c.index.identity, c.index.parse
    assert parse is not None
    return RemoteExperts(f"127.0.0.1:{port}", model_id, timeout_s=10,
                         shared=SharedCompute(FastOps("c-portable", threads=2), parse) if shared else None)


def batch(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (rng.standard_normal((t, D), dtype=np.float32), rng.integers(0, E, (t, K)).astype(np.int32),
            rng.random((t, K), dtype=np.float32))


def test_a_roomy_tier_reads_into_shared_memory_with_the_same_bits(model: Path) -> None:
    with Container.open(model) as c:
        index = c.index
        with ExpertTier.open(index, TierConfig(budget_bytes=index.total_bytes), depth=2) as plain:
            plain.preload()
            with plain.acquire(1, range(E)) as got:
                want = {e: [np.array(m.data, copy=True) for m in (w.gate, w.up, w.down)] for e, w in got.items()}
        with ExpertTier.open(index, TierConfig(budget_bytes=index.total_bytes), depth=2) as tier:
            assert tier.share() is None  # not in shared memory
            assert tier.use_shared_memory()
            assert tier.share() is None  # nothing resident yet
            tier.preload()
            shared = tier.share()
            assert shared is not None and tier.share() is shared and tier.shared is shared
            assert shared.table.shape == (len(index.records), 4)
            assert [tuple(r[:2]) for r in shared.table.tolist()] == sorted(index.records)
            memory = np.frombuffer(shared.mapping, dtype=np.uint8)
            for layer, expert, off, n in shared.table.tolist():
                loc = index.records[(layer, expert)]
                assert off % mmap.PAGESIZE == 0 and n == loc.length and off + n <= shared.size
                with open(index.root / loc.path, "rb") as f:  # the record's verified bytes, as on disk
                    f.seek(loc.offset)
                    assert memory[off : off + n].tobytes() == f.read(n)
            with tier.acquire(1, range(E)) as got:
                for e, w in got.items():
                    for m, old in zip((w.gate, w.up, w.down), want[e], strict=True):
                        np.testing.assert_array_equal(m.data, old)
                        assert np.shares_memory(m.data, memory)  # computed from the shared memory
            hits = tier.stats().hits[2]
            tier.note_shared(2, np.array([0, 3]), np.array([2, 1]))
            assert tier.stats().hits[2] == hits + 3 and tier.heat().uses[1, 0] >= 2
        small = TierConfig(budget_bytes=index.total_bytes - 1)  # never roomy: nothing to share
        with ExpertTier.open(index, small, depth=2) as tier:
            assert not tier.use_shared_memory()
            tier.preload()
            assert tier.share() is None


async def test_a_worker_computes_shared_experts_with_the_stores_bits(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    async with store(model, tmp_path) as (server, port):
        here, there = worker_side(model, port), worker_side(model, port, shared=False)
        try:
            n = 0
            for t in (1, 3, 40):
                for layer in LAYERS:
                    x, ids, w = batch(rng, t)
                    got = await asyncio.to_thread(here.moe, layer, x, ids, w)
                    want = await asyncio.to_thread(there.moe, layer, x, ids, w)
                    np.testing.assert_array_equal(got, want)
                    n += 1
                    # a sharded placement's call: slots of another store (-1) left out, each slot's output
                    ids[0, 0] = -1
                    call = await asyncio.to_thread(here.moe_start, layer, x, ids, w, slot_outputs=True)
                    assert isinstance(call, DoneCall)  # nothing was sent
                    ref = await asyncio.to_thread(there.moe_start, layer, x, ids, w, slot_outputs=True)
                    np.testing.assert_array_equal(call.result(), await asyncio.to_thread(ref.result))
                    n += 1
            assert here.stats.shared_calls == n and here.stats.calls == 0 and not here.wants_hints()
            assert there.stats.calls == n and there.stats.shared_calls == 0
            core = server.core
            counts = core._counts.copy()
            answered = core.metrics.calls.labels(layer="1")._value.get()
            await asyncio.to_thread(here.flush_usage, True)
            for _ in range(200):  # the lane's thread counts the report
                if core.metrics.shared_calls.labels(layer="1")._value.get() == n // 2:
                    break
                await asyncio.sleep(0.01)
            assert core.metrics.shared_calls.labels(layer="1")._value.get() == n // 2
            assert core.metrics.shared_calls.labels(layer="2")._value.get() == n // 2
            assert core._counts.sum() > counts.sum()  # the heat map sees them
            assert core.metrics.calls.labels(layer="1")._value.get() == answered  # none was sent to the store
        finally:
            here.close()
            there.close()


async def test_a_store_gone_fails_the_next_call_as_any_call(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    async with store(model, tmp_path) as (server, port):
        here = worker_side(model, port)
        x, ids, w = batch(rng, 2)
        await asyncio.to_thread(here.moe, 1, x, ids, w)
        assert here.stats.shared_calls == 1
        await server.stop(0)
        with pytest.raises(Unavailable):  # not computed from the memory of a store that is gone
            await asyncio.to_thread(here.moe, 1, x, ids, w)
        here.close()


async def test_either_setting_turns_sharing_off(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    x, ids, w = batch(rng, 2)
    async with store(model, tmp_path / "a", share=False) as (server, port):
        assert server.core.tier.shared is None
        here = worker_side(model, port)
        await asyncio.to_thread(here.moe, 1, x, ids, w)
        assert here.stats.calls == 1 and here.stats.shared_calls == 0
        here.close()
    async with store(model, tmp_path / "b") as (server, port):
        assert server.core.tier.shared is not None
        there = worker_side(model, port, shared=False)  # inference.shared_experts false
        await asyncio.to_thread(there.moe, 1, x, ids, w)
        assert there.stats.calls == 1 and there.stats.shared_calls == 0
        there.close()


def test_usage_counts_the_calls_however_often_it_folds() -> None:
    """The calls a worker computed from the shared experts reach the store as the same counts
    whether they were folded as they came (FOLD_CALLS) or counted when the report was made."""
    from moetier.rpc.tensors import from_pb
    from services.dense_worker.remote import _Usage

    rng = np.random.default_rng(9)
    calls = [(int(rng.integers(0, 3)), sorted({int(e) for e in rng.integers(0, 8, 4)}), int(rng.integers(1, 5)))
             for _ in range(50)]
    reports = []
    for fold in (7, 10_000):
        u = _Usage()
        u.FOLD_CALLS = fold
        for layer, union, rows in calls:
            u.add(layer, union, [e % 3 + 1 for e in union], rows)
        assert not u.empty
        (msg,) = u.messages()
        ex, ly = from_pb(msg.experts, "experts"), from_pb(msg.layers, "layers")
        reports.append((sorted(map(tuple, ex.tolist())), sorted(map(tuple, ly.tolist()))))
    assert reports[0] == reports[1]
    ex_rows, ly_rows = reports[0]
    assert sum(r[1] for r in ly_rows) == 50 and sum(r[2] for r in ly_rows) == sum(c[2] for c in calls)
    assert sum(r[2] for r in ex_rows) == sum(len(c[1]) for c in calls)


async def test_a_worker_computes_a_whole_layer_from_the_shared_experts(model: Path, tmp_path: Path) -> None:
    """RemoteExperts.resident_table: every expert of a layer the store shares, as one kernel-side
    table for FastOps.moe_block (MoeBlock.block: the layer's norm, router, experts and combine in
    one call). Its answers are the store's bits, its calls are counted as shared calls and reach
    the store; there is no table for an expert the store lacks, for other kernels, or once the
    store is gone."""
    rng = np.random.default_rng(8)
    router = quantize(rng.standard_normal((E, D), dtype=np.float32), "int8", 32)
    norm = (rng.random(D, dtype=np.float32) + 0.5).astype(np.float32)
    args = SimpleNamespace(norm_topk_prob=True, routed_scaling_factor=2.5)
    async with store(model, tmp_path) as (server, port):
        here, there = worker_side(model, port), worker_side(model, port, shared=False)
        try:
            assert here.shared is not None
            ops = here.shared.ops
            for layer in LAYERS:
                table = await asyncio.to_thread(here.resident_table, layer, ops, E)
                assert table is not None and here.resident_table(layer, ops, E) is table  # made once
                for t in (1, 3):
                    x = rng.standard_normal((t, D), dtype=np.float32)
                    got, ids, w = ops.moe_block(x, norm, 1e-6, router, None, K, True, 2.5, table)
                    here.resident_done(layer, ids, t, 0.0)
                    h = ops.rmsnorm(x, norm, 1e-6)
                    routed = ops.route_softmax(h, router, None, K)
                    assert routed is not None
                    want_w = routing_weights(routed[1], args)  # type: ignore[arg-type]
                    y = await asyncio.to_thread(there.moe, layer, h, routed[0], want_w)  # the store computes
                    np.testing.assert_array_equal(ids, routed[0])
                    np.testing.assert_array_equal(w.view(np.uint32), want_w.view(np.uint32))
                    np.testing.assert_array_equal(got.view(np.uint32), (x + y).view(np.uint32))
            assert here.stats.shared_calls == 4 and here.stats.rows == 8 and here.stats.calls == 0
            assert not here.wants_hints()
            assert here.resident_table(1, FastOps("c-portable", threads=1), E) is None  # not this worker's kernels
            assert here.resident_table(1, ops, E + 1) is None  # an expert the store does not have
            await asyncio.to_thread(here.flush_usage, True)
            core = server.core
            for _ in range(200):  # the lane's thread counts the report
                if core.metrics.shared_calls.labels(layer="2")._value.get() == 2:
                    break
                await asyncio.sleep(0.01)
            assert core.metrics.shared_calls.labels(layer="1")._value.get() == 2
            assert core.metrics.shared_calls.labels(layer="2")._value.get() == 2
            await server.stop(0)
            assert await asyncio.to_thread(here.resident_table, 1, ops, E) is None  # not from a store that is gone
        finally:
            here.close()
            there.close()
