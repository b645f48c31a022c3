"""MemberAgent against a real in-process router: register, heartbeat with load, survive the
router's absence and restart, re-register when forgotten, stop cleanly."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from test_router import router_settings

from moetier.cluster import MemberAgent
from moetier.launch import free_ports
from moetier.rpc.v1 import dense_worker_pb2, router_pb2, router_pb2_grpc
from services.router.server import RouterServer, create_server

pytestmark = pytest.mark.timeout(30)


async def start_router(port: int = 0, **settings: object) -> tuple[RouterServer, int]:
    server, bound = create_server(router_settings(**settings), f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def members(port: int) -> dict[str, router_pb2.Member]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        st = await router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=2)
    return {m.member_id: m for m in st.members}


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def agents() -> AsyncIterator[list[MemberAgent]]:
    started: list[MemberAgent] = []
    yield started
    for a in started:
        await a.stop()


def agent(port: int, started: list[MemberAgent], **kw: object) -> MemberAgent:
    a = MemberAgent(f"127.0.0.1:{port}", "dense_worker", "w1", "127.0.0.1:5555", model_id="m",
                    heartbeat_interval_s=0.05, rpc_timeout_s=0.5, backoff_s=(0.02, 0.1), **kw)  # type: ignore[arg-type]
    started.append(a)
    a.start()
    return a


async def test_registers_and_reports_load(agents: list[MemberAgent]) -> None:
    server, port = await start_router()
    try:
        calls = 0

        def load() -> dense_worker_pb2.WorkerLoad:
            nonlocal calls
            calls += 1
            return dense_worker_pb2.WorkerLoad(running=3, max_batch=8, max_waiting=2)

        a = agent(port, agents, load=load)
        await asyncio.wait_for(a.registered.wait(), 2)
        assert a.heartbeat_interval_s == pytest.approx(0.1)  # the router's interval wins

        async def reported() -> bool:
            m = (await members(port)).get("w1")
            return m is not None and m.load.running == 3

        await eventually(reported)
        m = (await members(port))["w1"]
        assert (m.kind, m.address, m.model_id) == (router_pb2.MEMBER_KIND_DENSE_WORKER, "127.0.0.1:5555", "m")
        assert calls >= 1 and a.registrations == 1
    finally:
        await server.stop(0)


async def test_survives_router_absence_and_reregisters_after_restart(agents: list[MemberAgent]) -> None:
    (port,) = free_ports(1)
    a = agent(port, agents)
    await asyncio.sleep(0.3)  # nothing listens yet: the agent retries, never crashes
    assert not a.registered.is_set() and a._task is not None and not a._task.done()
    server, _ = await start_router(port)
    await asyncio.wait_for(a.registered.wait(), 3)
    assert "w1" in await members(port)
    await server.stop(0)
    # A new router on the same address knows nobody: the agent registers again.
    server, _ = await start_router(port)
    try:
        async def known() -> bool:
            return "w1" in await members(port)

        await eventually(known)
        assert a.registrations == 2
    finally:
        await server.stop(0)


async def test_reregisters_when_forgotten(agents: list[MemberAgent]) -> None:
    server, port = await start_router()
    try:
        a = agent(port, agents)
        await asyncio.wait_for(a.registered.wait(), 2)
        server.core.registry.remove("w1", "expired")

        async def back() -> bool:
            return "w1" in await members(port)

        await eventually(back)
        assert a.registrations == 2
    finally:
        await server.stop(0)


async def test_broken_load_callback_keeps_membership(agents: list[MemberAgent],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    server, port = await start_router(member_expiry_s=0.3)
    try:
        def load() -> dense_worker_pb2.WorkerLoad:
            raise RuntimeError("engine not ready")

        a = agent(port, agents, load=load)
        await asyncio.wait_for(a.registered.wait(), 2)
        with caplog.at_level(logging.ERROR, logger="moetier.cluster"):
            await asyncio.sleep(0.6)  # twice the expiry: heartbeats without load kept it
        assert "w1" in await members(port) and a.registrations == 1
        assert "load report failed" in caplog.text
    finally:
        await server.stop(0)


async def test_stop_is_clean_and_idempotent(agents: list[MemberAgent]) -> None:
    server, port = await start_router()
    try:
        a = agent(port, agents)
        await asyncio.wait_for(a.registered.wait(), 2)
        await a.stop()
        await a.stop()
        assert a._task is None
    finally:
        await server.stop(0)


def test_from_settings_uses_the_member_endpoint() -> None:
    s = router_settings()
    a = MemberAgent.from_settings(s, "expert_store", model_id="m", owned=[(1, 0, 8)])
    assert (a.router_address, a.member_id) == (s.router.address, s.expert_store.id)
    req = a._register_req
    assert req.kind == router_pb2.MEMBER_KIND_EXPERT_STORE and req.address == s.expert_store.address
    assert req.metrics_address == f"127.0.0.1:{s.expert_store.metrics_port}"
    assert [(r.layer, r.first, r.last) for r in req.owned] == [(1, 0, 8)]
