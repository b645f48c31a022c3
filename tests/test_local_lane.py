"""The expert store's local lane (moetier/rpc/local.py): the same answers as gRPC, bit for bit,
the same errors, a region too small falls back to gRPC, a broken lane is reconnected, a caller
that does not know the store's token is refused, and shared-memory tensors never pass on gRPC."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from moetier.convert import synth
from moetier.errors import InvalidArgument, ResourceExhausted, Unavailable
from moetier.rpc.local import LocalClient
from moetier.rpc.tensors import from_pb, to_pb
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.settings import load_settings
from services.dense_worker.remote import RemoteExperts
from services.expert_store.server import GRPC_OPTIONS, StoreServer, create_server

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the local lane is Linux-only")]

D, E, K = 64, 8, 2  # tiny-deepseek_v3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("lane") / "tiny", 0)


@asynccontextmanager
async def store(model: Path, tmp_path: Path, **cache: Any) -> AsyncIterator[tuple[StoreServer, int]]:
    settings = load_settings(overrides={
        "model": {"path": str(model), "expert_cache": cache.get("expert_cache", "100%")},
        "cache": {"policy": "lru"}, "storage": {"preload": False}, "data_dir": str(tmp_path / "data"),
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0}}, environ={})
    server, port = create_server(settings, "127.0.0.1:0", threads=1)
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(0)


async def info(port: int) -> pb.InfoResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return await pb_grpc.ExpertStoreStub(ch).Info(pb.InfoRequest(), timeout=5)


def batch(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (rng.standard_normal((t, D), dtype=np.float32), rng.integers(0, E, (t, K)).astype(np.int32),
            rng.random((t, K), dtype=np.float32))


async def test_the_lane_answers_as_grpc_does(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    async with store(model, tmp_path) as (server, port):
        i = await info(port)
        assert i.local_socket.startswith("@moetier-") and len(i.local_token) == 32
        lane = await asyncio.to_thread(LocalClient.connect, i.local_socket, i.local_token)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
            stub = pb_grpc.ExpertStoreStub(ch)
            try:
                for t in (1, 3, 200):  # decode rows, a few, a prefill chunk
                    for layer in (1, 2):
                        x, ids, w = batch(rng, t)
                        resp, out = await asyncio.to_thread(
                            lane.compute, pb.ComputeExpertsRequest(layer=layer, step=1), x, ids, w, 10)
                        want = await stub.ComputeExperts(pb.ComputeExpertsRequest(
                            layer=layer, hidden=to_pb(x), expert_ids=to_pb(ids), weights=to_pb(w)), timeout=10)
                        np.testing.assert_array_equal(out, from_pb(want.output, "output"))
                        assert resp.hits + resp.misses == len(np.unique(ids)) and resp.compute_ns > 0
                # the same errors as gRPC: a dense layer, an expert id out of range
                x, ids, w = batch(rng, 2)
                with pytest.raises(InvalidArgument, match="layer 0 is not a MoE layer"):
                    await asyncio.to_thread(lane.compute, pb.ComputeExpertsRequest(layer=0), x, ids, w, 10)
                with pytest.raises(InvalidArgument, match=r"expert id 9 .* outside"):
                    await asyncio.to_thread(lane.compute, pb.ComputeExpertsRequest(layer=1), x,
                                            np.full((2, K), 9, np.int32), w, 10)
                _, out = await asyncio.to_thread(lane.compute, pb.ComputeExpertsRequest(layer=1), x, ids, w, 10)
                assert out.shape == (2, D)  # the lane stays usable after an error
                # hints arrive as over gRPC
                before = server.core.tier_stats().prefetch_hints
                await asyncio.to_thread(lane.prefetch, pb.PrefetchRequest(layer=2, expert_ids=[1, 2, 3]))
                for _ in range(200):
                    if server.core.tier_stats().prefetch_hints == before + 3:
                        break
                    await asyncio.sleep(0.01)
                assert server.core.tier_stats().prefetch_hints == before + 3
            finally:
                lane.close()


async def test_the_store_says_resource_exhausted_on_the_lane_too(model: Path, tmp_path: Path) -> None:
    rec = 8192
    async with store(model, tmp_path, expert_cache=str(rec + 4096)) as (server, port):  # room for one record
        i = await info(port)
        lane = await asyncio.to_thread(LocalClient.connect, i.local_socket, i.local_token)
        try:
            held = await asyncio.to_thread(server.core.tier.pin, 1, [0])
            x, _, w = batch(np.random.default_rng(1), 1)
            with pytest.raises(ResourceExhausted, match="budget") as e:
                await asyncio.to_thread(lane.compute, pb.ComputeExpertsRequest(layer=1), x,
                                        np.array([[3, 3]], np.int32), w, 10)
            assert e.value.retry_after_s > 0
            held.release()
        finally:
            lane.close()


async def test_a_wrong_token_is_refused_and_grpc_refuses_shared_tensors(model: Path, tmp_path: Path) -> None:
    async with store(model, tmp_path) as (_, port):
        i = await info(port)
        with pytest.raises(Unavailable, match="wrong token"):
            await asyncio.to_thread(LocalClient.connect, i.local_socket, "0" * 32)
        with pytest.raises(Unavailable):
            await asyncio.to_thread(LocalClient.connect, "@moetier-nobody-listens-here", i.local_token)
        lane = await asyncio.to_thread(LocalClient.connect, i.local_socket, i.local_token)
        try:  # a request naming the lane's shared memory, sent over gRPC instead: refused, nothing read
            x, ids, w = batch(np.random.default_rng(2), 1)
            req = pb.ComputeExpertsRequest(layer=1)
            lane.send_compute(req, x, ids, w)  # fills req's tensors with slices of the region
            lane.receive(req, 10)
        finally:
            lane.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.ExpertStoreStub(ch).ComputeExperts(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shared-memory tensor outside a local lane" in err.value.details()


async def test_tensors_too_large_for_the_region_go_over_grpc(model: Path, tmp_path: Path) -> None:
    async with store(model, tmp_path) as (_, port):
        i = await info(port)
        lane = await asyncio.to_thread(LocalClient.connect, i.local_socket, i.local_token, 4096)
        try:
            x, ids, w = batch(np.random.default_rng(3), 64)  # 16 KiB of hidden rows
            with pytest.raises(ValueError, match="do not fit"):
                lane.send_compute(pb.ComputeExpertsRequest(layer=1), x, ids, w)
        finally:
            lane.close()


async def test_remote_experts_reconnect_the_lane_after_a_store_restart(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    x, ids, w = batch(rng, 2)
    async with store(model, tmp_path / "a") as (_, port):
        remote = RemoteExperts(f"127.0.0.1:{port}", (await info(port)).model_id, timeout_s=5, hidden_size=D)
        first = await asyncio.to_thread(remote.moe, 1, x, ids, w)
        lane = remote._lane
        assert lane is not None and not lane.closed
    with pytest.raises(Unavailable):  # the store is gone: the call fails as over gRPC, within its deadline
        await asyncio.to_thread(remote.moe, 1, x, ids, w)
    assert remote._lane is None and lane.closed
    async with store(model, tmp_path / "b") as (_, port2):
        remote.address = f"127.0.0.1:{port2}"
        again = await asyncio.to_thread(remote.moe, 1, x, ids, w)
        assert remote._lane is not None and remote._lane is not lane  # a new lane, to the new store
        np.testing.assert_array_equal(again, first)
        remote.close()


async def test_a_store_stopping_without_grace_cuts_a_lane_call_waiting_for_its_reads(model: Path,
                                                                                     tmp_path: Path) -> None:
    """stop(0) does not wait for a lane call in flight (as gRPC's stop(0) cancels its calls): the
    caller gets UNAVAILABLE while the call's read is still held."""
    from helpers_store import Disk

    x, ids, w = batch(np.random.default_rng(5), 1)
    settings = load_settings(overrides={
        "model": {"path": str(model), "expert_cache": "100%"}, "cache": {"policy": "lru"}, "storage": {"preload": False},
        "data_dir": str(tmp_path / "data"),
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0}}, environ={})
    server, port = create_server(settings, "127.0.0.1:0", threads=1)
    await server.start()
    disk = Disk(server.core.tier.engine, hold=True)
    remote = RemoteExperts(f"127.0.0.1:{port}", (await info(port)).model_id, timeout_s=20, hidden_size=D)
    stopping: asyncio.Future[None] | None = None
    try:
        call = asyncio.ensure_future(asyncio.to_thread(remote.moe, 1, x, ids, w))
        await asyncio.to_thread(disk.wait_active, 1)
        assert remote._lane is not None
        stopping = asyncio.ensure_future(server.stop(0))
        with pytest.raises(Unavailable, match="closed the lane"):
            await asyncio.wait_for(call, 10)
        assert disk.active >= 1  # cut, not answered: the read is still held
    finally:
        disk.gate.set()
        await (stopping if stopping is not None else server.stop(0))
        remote.close()
