"""Experts sharded over several expert stores: ownership specs, the placement map (weighted by
bandwidth, minimal movement), the stores' shards (configured, or layer files absent from their
directory), and the dense worker's ShardedExperts against a router and three stores holding
disjoint and overlapping shards: bit for bit one store's output, a dead store's experts taken
over by their other owners, UNAVAILABLE naming the layer and experts nobody holds, a restarted
store taken back."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from moetier.convert import synth
from moetier.errors import InvalidArgument, RowsUnavailable, Unavailable
from moetier.placement import ExpertRange, PlacementMap, StoreEntry, from_ranges, parse_owned, to_ranges
from moetier.rpc.tensors import from_pb, to_pb
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.rpc.v1 import router_pb2, router_pb2_grpc
from moetier.settings import load_settings
from moetier.weights.container import Container
from services.dense_worker.remote import RemoteExperts
from services.dense_worker.sharded import ShardedExperts
from services.expert_store.server import GRPC_OPTIONS, StoreServer
from services.expert_store.server import create_server as create_store
from services.router.server import RouterServer
from services.router.server import create_server as create_router

pytestmark = pytest.mark.timeout(120)

D, E, K = 64, 8, 2  # tiny-deepseek_v3: MoE layers 1 and 2


# ---- ownership specs and the map ---------------------------------------------------------

def test_owned_specs_name_layers_and_experts() -> None:
    layers = [1, 2, 3]
    assert parse_owned("all", layers, 4) == {(la, e) for la in layers for e in range(4)}
    assert parse_owned("2", layers, 4) == {(2, e) for e in range(4)}
    assert parse_owned("1-3:0-1, 3:3", layers, 4) == {(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (3, 3)}
    for bad, why in (("x", "not a number"), ("3-1", "empty"), ("7", "no MoE layer"), ("1:4", "outside")):
        with pytest.raises(InvalidArgument, match=why):
            parse_owned(bad, layers, 4)
    # layer-interleaved shards by replica ordinal: N replicas, each layer on R of them
    assert parse_owned("0/2", layers, 2) == {(1, 0), (1, 1), (3, 0), (3, 1)}
    assert parse_owned(" 1 / 2 ", layers, 2) == {(2, 0), (2, 1)}
    for n, r in ((3, 1), (3, 2), (2, 2)):
        shards = [parse_owned(f"{i}/{n}*{r}", layers, 2) for i in range(n)]
        for layer in layers:  # every expert on exactly R replicas
            assert sum((layer, 0) in s for s in shards) == r
    assert parse_owned("2/3*2", layers, 2) == {(3, 0), (3, 1), (1, 0), (1, 1)}  # wraps around
    for bad, why in (("3/3", "0 <= I < N"), ("0/2*3", "1 <= R <= N"), ("0/0", "0 <= I < N"),
                     ("0/4", "leave some shard empty")):
        with pytest.raises(InvalidArgument, match=re.escape(why)):
            parse_owned(bad, layers, 4)
    keys = parse_owned("1-3:0-1, 3:3", layers, 4)
    assert to_ranges(keys) == [ExpertRange(1, 0, 2), ExpertRange(2, 0, 2), ExpertRange(3, 0, 2),
                               ExpertRange(3, 3, 4)]
    assert from_ranges(to_ranges(keys)) == keys


def test_the_map_weights_by_bandwidth_and_moves_only_what_it_must() -> None:
    everything = (ExpertRange(1, 0, 4000),)
    pmap = PlacementMap.weighted([("a", "a:1", 3e9, everything), ("b", "b:1", 1e9, everything)])
    share = pmap.placed([1], 4000)
    assert 0.70 < share["a"] / 4000 < 0.80  # 3:1 bandwidth, 3:1 share
    # unknown bandwidth weighs as the mean of the known ones
    assert PlacementMap.weighted([("a", "", 2e9, ()), ("b", "", 0, ())]).stores[1].weight == 2e9
    # a third store joins: the experts that move all move to it
    bigger = PlacementMap.weighted([("a", "a:1", 3e9, everything), ("b", "b:1", 1e9, everything),
                                    ("c", "c:1", 2e9, everything)])
    for e in range(4000):
        before, after = pmap.stores[pmap.owner((1, e)) or 0], bigger.stores[bigger.owner((1, e)) or 0]
        assert after.member_id in (before.member_id, "c")
    # an expert whose owners are all down is reported, never dropped
    assign, missing = pmap.assign(1, [0, 1, 2], down=frozenset({"a", "b"}))
    assert assign == {} and missing == [0, 1, 2]
    shard = PlacementMap([StoreEntry("a", "", 1.0, (ExpertRange(1, 0, 2),))])
    assert shard.assign(1, [0, 1, 2]) == ({0: [0, 1]}, [2])


# ---- stores with shards --------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("shards") / "tiny", 0)


def store_settings(model: Path, tmp: Path, store_id: str, owned: str = "all", router: str = "") -> Any:
    return load_settings(overrides={
        "model": {"path": str(model), "expert_cache": "100%"}, "cache": {"policy": "lru"},
        # equal weights (GB/s), not a probe a busy machine skews: each store's share is the hash's alone
        "storage": {"owned_experts": owned, "mirror_weights": [1.0]}, "data_dir": str(tmp / store_id),
        "heartbeat_interval_s": 0.1,
        "router": {"address": router},
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": store_id}},
        environ={})


@asynccontextmanager
async def running_store(model: Path, tmp: Path, store_id: str, owned: str = "all",
                        router: str = "") -> AsyncIterator[tuple[StoreServer, int]]:
    server, port = create_store(store_settings(model, tmp, store_id, owned, router), "127.0.0.1:0",
                                register=bool(router), threads=1)
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(0)


async def compute(port: int, req: pb.ComputeExpertsRequest) -> pb.ComputeExpertsResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        return await pb_grpc.ExpertStoreStub(ch).ComputeExperts(req, timeout=10)


def batch(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)  # distinct experts per row
    return rng.standard_normal((t, D), dtype=np.float32), ids, rng.random((t, K), dtype=np.float32)


async def test_a_store_serves_its_shard_and_refuses_the_rest(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x, ids, w = batch(rng, 3)
    async with running_store(model, tmp_path, "s", owned="1:0-3, 2") as (server, port):
        info = server.core.info()
        assert [(r.layer, r.first, r.last) for r in info.owned] == [(1, 0, 4), (2, 0, 8)]
        ids1 = np.where(ids < 4, ids, 0).astype(np.int32)
        await compute(port, pb.ComputeExpertsRequest(layer=1, hidden=to_pb(x), expert_ids=to_pb(ids1),
                                                     weights=to_pb(w)))
        ids_out = ids1.copy()
        ids_out[0, 0] = 6
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await compute(port, pb.ComputeExpertsRequest(layer=1, hidden=to_pb(x), expert_ids=to_pb(ids_out),
                                                         weights=to_pb(w)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "does not hold layer 1 experts [6]" in (e.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await compute(port, pb.ComputeExpertsRequest(layer=2, hidden=to_pb(x), weights=to_pb(w),
                                                         expert_ids=to_pb(np.full_like(ids, -1)), slot_outputs=True))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "every slot is -1" in (e.value.details() or "")
        heat = server.core.heat()
        assert (heat.tier[0, 4:] == 255).all() and (heat.tier[0, :4] != 255).all() and (heat.tier[1] != 255).all()


async def test_slot_outputs_combine_to_the_single_store_bits(model: Path, tmp_path: Path) -> None:
    """The wire contract ShardedExperts relies on, checked on one store: the slots of two
    disjoint halves, placed and summed in k order, are the combined answer bit for bit."""
    from moetier.model.ops import combine_slots

    rng = np.random.default_rng(2)
    async with running_store(model, tmp_path, "s") as (_, port):
        for t in (1, 5, 64):
            x, ids, w = batch(rng, t)
            whole = from_pb((await compute(port, pb.ComputeExpertsRequest(
                layer=2, hidden=to_pb(x), expert_ids=to_pb(ids), weights=to_pb(w)))).output, "out")
            slots = np.zeros((t, K, D), dtype=np.float32)
            for half in (ids < 4, ids >= 4):
                if not half.any():
                    continue
                resp = await compute(port, pb.ComputeExpertsRequest(
                    layer=2, hidden=to_pb(x), weights=to_pb(w), slot_outputs=True,
                    expert_ids=to_pb(np.where(half, ids, -1).astype(np.int32))))
                slots[half] = from_pb(resp.output, "slots")
            np.testing.assert_array_equal(combine_slots(slots, w), whole)
            assert whole.tobytes() == combine_slots(slots, w).tobytes()


async def test_a_store_on_a_partial_copy_owns_the_layers_it_has(model: Path, tmp_path: Path) -> None:
    part = tmp_path / "part"
    shutil.copytree(model, part)
    os.unlink(part / "experts" / "layer-002.bin")
    async with running_store(part, tmp_path, "p") as (server, _):
        assert [(r.layer, r.first, r.last) for r in server.core.owned] == [(1, 0, 8)]
    with pytest.raises(InvalidArgument, match="holds none of the experts"):
        create_store(store_settings(part, tmp_path, "q", owned="2"), "127.0.0.1:0", threads=1)


# ---- the worker's side: router + three stores ------------------------------------------

async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def placement(router_port: int) -> router_pb2.PlacementResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as ch:
        return await router_pb2_grpc.RouterStub(ch).Placement(router_pb2.PlacementRequest(), timeout=5)


@asynccontextmanager
async def router() -> AsyncIterator[tuple[RouterServer, int]]:
    settings = load_settings(overrides={
        "router": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0},
        "heartbeat_interval_s": 0.1, "member_expiry_s": 2.0}, environ={})
    server, port = create_router(settings, "127.0.0.1:0")
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(0)


# a: every expert of layer 1; b: every expert of layer 2; c: experts 0-3 of both (overlaps a and b)
SHARDS = {"a": "1", "b": "2", "c": "1-2:0-3"}


async def test_sharded_stores_give_one_stores_bits_survive_a_death_and_take_a_store_back(
        model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    batches = [batch(rng, t) for t in (1, 2, 7, 33)]
    async with router() as (rtr, rport), running_store(model, tmp_path, "ref") as (_, ref_port):
        with Container.open(model) as c:
            model_id = c.index.identity
        reference = RemoteExperts(f"127.0.0.1:{ref_port}", model_id, timeout_s=10)
        stores: dict[str, Any] = {}
        for sid, owned in SHARDS.items():
            stores[sid] = running_store(model, tmp_path, sid, owned, router=f"127.0.0.1:{rport}")
            stores[f"{sid}_server"], _ = await stores[sid].__aenter__()
        try:
            await eventually(lambda: _n_stores(rport, 3))
            want = {(layer, n): await asyncio.to_thread(reference.moe, layer, *b)
                    for layer in (1, 2) for n, b in enumerate(batches)}
            sharded = ShardedExperts(f"127.0.0.1:{rport}", model_id, timeout_s=5, refresh_s=0.1,
                                     down_s=0.5)
            try:
                await asyncio.to_thread(sharded.check)

                async def all_equal() -> None:
                    for (layer, n), out in want.items():
                        got = await asyncio.to_thread(sharded.moe, layer, *batches[n])
                        assert got.tobytes() == out.tobytes(), f"layer {layer} batch {n} differs"

                await all_equal()
                if hasattr(os, "memfd_create"):  # stores on this host: every call went over their local lanes
                    assert all(c._lane is not None for c in sharded._stores.values())
                calls = sharded.stats.calls
                assert calls > len(want)  # some layers' unions went to two stores
                status = rtr.core.status()
                placed = {m.member.member_id: m.placed_experts for m in status.members}
                assert all(placed[s] > 0 for s in "abc") and sum(placed.values()) == 16, placed
                assert all(m.member.info.read_bandwidth == 1e9 for m in status.members)  # the configured weight

                # a put aside (as after one failed call) while it alone owns layer 1's experts 4-7:
                # tried again before those rows fail, and it serves
                sharded._down["a"] = (time.monotonic() + 60, sharded._stores["a"].address)
                got = await asyncio.to_thread(sharded.moe, 1, *batches[3])
                assert got.tobytes() == want[(1, 3)].tobytes()
                assert "a" not in sharded._down  # it answered: no longer put aside

                # a put aside again (as after it restarted), then c dies without a word (no drain:
                # still in the map until it expires): a and b own all c had, and the steps that
                # find c gone are computed again there -- a included, tried again though put aside
                sharded._down["a"] = (time.monotonic() + 60, sharded._stores["a"].address)
                failed = sharded.stats.failed_calls
                stores["c_server"].agent._drain_on_stop = False
                await stores.pop("c").__aexit__(None, None, None)
                await all_equal()
                assert sharded.stats.failed_calls > failed
                assert "a" not in sharded._down and "c" in sharded._down

                # c comes back, then a dies: layer 1's experts 0-3 have an owner (c), 4-7 none. The
                # rows needing 4-7 are named (the worker fails only their requests); a batch that
                # needs only 0-3 computes, bit for bit; layer 2 still computes
                stores["c"] = running_store(model, tmp_path, "c", SHARDS["c"], router=f"127.0.0.1:{rport}")
                await stores["c"].__aenter__()
                await eventually(lambda: _n_stores(rport, 3))
                await stores.pop("a").__aexit__(None, None, None)
                await eventually(lambda: _n_stores(rport, 2))
                x, ids, w = batches[3]
                with pytest.raises(RowsUnavailable) as e:
                    await asyncio.to_thread(sharded.moe, 1, x, ids, w)
                assert e.value.rows == frozenset(np.flatnonzero((ids >= 4).any(axis=1)).tolist())
                assert "layer 1: no live expert store holds experts [" in str(e.value)
                assert all(str(k) in str(e.value) for k in np.unique(ids[ids >= 4]))
                low = np.where(ids >= 4, ids - 4, ids).astype(np.int32)  # rows still distinct experts
                got = await asyncio.to_thread(sharded.moe, 1, x, low, w)
                assert got.tobytes() == (await asyncio.to_thread(reference.moe, 1, x, low, w)).tobytes()
                got = await asyncio.to_thread(sharded.moe, 2, *batches[3])
                assert got.tobytes() == want[(2, 3)].tobytes()

                # a comes back: it is taken into the map and layer 1 computes again
                stores["a"] = running_store(model, tmp_path, "a", SHARDS["a"], router=f"127.0.0.1:{rport}")
                await stores["a"].__aenter__()
                await eventually(lambda: _n_stores(rport, 3))
                await eventually(lambda: _computes(sharded, 1, batches[0]))
                await all_equal()
            finally:
                sharded.close()
        finally:
            reference.close()
            for sid, s in stores.items():
                if not sid.endswith("_server"):
                    await s.__aexit__(None, None, None)


async def _n_stores(router_port: int, n: int) -> bool:
    return len((await placement(router_port)).stores) == n


async def _computes(sharded: ShardedExperts, layer: int, b: tuple[np.ndarray, np.ndarray, np.ndarray]) -> bool:
    try:
        await asyncio.to_thread(sharded.moe, layer, *b)
    except Unavailable:
        return False
    return True


def test_a_step_fails_only_the_sequences_of_the_rows_without_an_owner() -> None:
    """The batcher's side of RowsUnavailable: rows are the step's, sequence by sequence."""
    from typing import cast

    from services.dense_worker.batcher import Batcher, Sequence, StepTimings, _Result

    seqs = [cast(Sequence, object()) for _ in range(3)]
    rows = [(seqs[0], np.zeros(4, dtype=np.int64)), (seqs[1], np.zeros(1, dtype=np.int64)),
            (seqs[2], np.zeros(2, dtype=np.int64))]  # rows 0-3, 4, 5-6

    def result(error: BaseException) -> _Result:
        return _Result(rows, [], [], cast(StepTimings, None), error)

    assert Batcher._failed_by(result(RowsUnavailable("x", frozenset({4, 6})))) == [seqs[1], seqs[2]]
    assert Batcher._failed_by(result(RowsUnavailable("x", frozenset({3})))) == [seqs[0]]
    assert Batcher._failed_by(result(Unavailable("store down"))) == seqs  # not row-wise: every sequence
