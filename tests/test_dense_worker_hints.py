"""RemoteExperts' prefetch hints: over gRPC handed to one sender thread (the step thread never
waits for a thread to start, as grpc's `future()` makes it on an idle channel), on the local lane
sent by the step thread itself (one packet, no thread at all); delivered to the store either way,
and the sender stopped by `close()`."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moetier.convert import synth
from moetier.settings import load_settings
from services.dense_worker.remote import RemoteExperts
from services.expert_store.server import StoreServer, create_server

pytestmark = pytest.mark.timeout(60)


async def start_store(tmp_path: Path, cache: str) -> tuple[StoreServer, int]:
    """An expert store over a tiny synth model with this expert cache, started; stop it with stop(0)."""
    model = synth.write_container("tiny-deepseek_v3", tmp_path / "m", 0)
    settings = load_settings(overrides={
        "model": {"path": str(model), "expert_cache": cache}, "cache": {"policy": "lru"},
        "storage": {"preload": False},  # a cold tier: these tests watch misses
        "data_dir": str(tmp_path / "data"),
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0}}, environ={})
    server, port = create_server(settings, "127.0.0.1:0", threads=1)
    await server.start()
    return server, port


def senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dense-worker-hints"]


@pytest.mark.parametrize("lane", [False, True], ids=["grpc", "local-lane"])
async def test_hints_reach_the_store_from_one_sender_thread(tmp_path: Path, lane: bool) -> None:
    server, port = await start_store(tmp_path, "100%")
    try:
        remote = RemoteExperts(f"127.0.0.1:{port}", server.core.shape.model_id, timeout_s=5, local_lane=lane)
        await asyncio.to_thread(remote.check)
        assert (remote._lane is not None) == lane
        layer = server.core.shape.moe_layers[0]

        def hint_all() -> tuple[int, int]:
            # counted from inside the executor thread, so starting that thread is not counted
            before = threading.active_count()
            for e in range(8):
                remote.new_step()
                remote.prefetch(layer, np.array([e], dtype=np.int32))
                time.sleep(0.01)  # each hint answered before the next: an idle channel every time
            return before, threading.active_count()

        before, after = await asyncio.to_thread(hint_all)
        if lane:
            assert senders() == [] and after == before, (before, after)
        else:
            assert len(senders()) == 1 and after <= before + 1, (before, after)
        deadline = time.monotonic() + 5
        while server.core.tier_stats().prefetch_hints < 8:
            assert time.monotonic() < deadline, "the hints did not reach the store"
            await asyncio.sleep(0.02)
        assert (remote.stats.hints_sent, remote.stats.hints_failed) == (8, 0)
        remote.close()
        deadline = time.monotonic() + 5
        while senders():
            assert time.monotonic() < deadline, "close() left the hint sender running"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(remote.check)  # a new channel: hints flow again
        await asyncio.to_thread(remote.prefetch, layer, np.array([1, 2], dtype=np.int32))
        assert remote.stats.hints_sent == 9
        remote.close()
    finally:
        await server.stop(0)


@pytest.mark.parametrize("lane", [False, True], ids=["grpc", "local-lane"])
@pytest.mark.parametrize("cache", ["100%", "50%"])
async def test_a_settled_store_says_so_and_hints_stop(tmp_path: Path, lane: bool, cache: str) -> None:
    """ComputeExpertsResponse.settled: true once a store whose cache holds every expert has
    answered SETTLE_STEPS steps without a miss (the worker then predicts no hints), false again
    after a miss, never with a smaller cache."""
    from moetier.store.tier import SETTLE_STEPS

    server, port = await start_store(tmp_path, cache)
    try:
        remote = RemoteExperts(f"127.0.0.1:{port}", server.core.shape.model_id, timeout_s=5, local_lane=lane)
        await asyncio.to_thread(remote.check)
        shape = server.core.shape
        x = np.ones((1, shape.hidden_size), dtype=np.float32)
        w = np.ones((1, 1), dtype=np.float32)
        layer = shape.moe_layers[0]
        assert remote.wants_hints()

        def steps(expert: int, n: int) -> list[bool]:
            seen = []
            for _ in range(n):
                remote.new_step()
                remote.moe(layer, x, np.array([[expert]], dtype=np.int32), w)
                seen.append(remote.wants_hints())
            return seen

        seen = await asyncio.to_thread(steps, 0, SETTLE_STEPS + 2)
        if cache == "100%":
            assert seen.index(False) >= SETTLE_STEPS - 1 and seen[-1] is False, seen
            assert await asyncio.to_thread(steps, 1, 1) == [True], "a miss left the store settled"
        else:
            assert all(seen), "a store that cannot hold every expert said it was settled"
        remote.close()
    finally:
        await server.stop(0)
