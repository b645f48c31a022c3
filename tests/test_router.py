"""The router, in process on port 0, in front of scripted fake dense workers.

FakeWorker streams `tokens` messages `delay_s` apart, can hold every stream at a gate,
records each request, its deadline and its cancellation, and dies when its server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moetier.errors import Unavailable
from moetier.prefix import block_hashes
from moetier.rpc.errors import RETRY_AFTER_KEY, rpc_errors
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc, generate_pb2, router_pb2, router_pb2_grpc
from moetier.settings import Settings, load_settings
from services.router.registry import MemberInfo, MemberKind, Registry
from services.router.server import SERVICE_NAME, RouterServer, create_server

pytestmark = pytest.mark.timeout(30)

DENSE = router_pb2.MEMBER_KIND_DENSE_WORKER
STORE = router_pb2.MEMBER_KIND_EXPERT_STORE


def router_settings(**top: Any) -> Settings:
    """Test settings: fast heartbeats, no metrics port, small default worker capacity."""
    overrides: dict[str, Any] = {
        "router": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "router"},
        "heartbeat_interval_s": 0.1, "member_expiry_s": 5.0, "queue_capacity": 8,
        "inference": {"max_batch_size": 4, "max_waiting": 0},
    }
    overrides.update(top)
    return load_settings(overrides=overrides, environ={})


class FakeWorker(dense_worker_pb2_grpc.DenseWorkerServicer):
    def __init__(self, tokens: int = 3, delay_s: float = 0.0, fail_after_first: str | None = None) -> None:
        self.tokens = tokens
        self.fail_after_first = fail_after_first  # the worker itself fails the request after its first token
        self.delay_s = delay_s
        self.gate: asyncio.Event | None = None  # when set up, streams wait for it after the first message
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.deadlines: list[float | None] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.cancelled_at = 0.0
        self.active = 0

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())
        self.active += 1
        self.started.set()
        try:
            for i in range(self.tokens):
                if i:
                    await asyncio.sleep(self.delay_s)
                if i == 1 and self.gate is not None:
                    await self.gate.wait()
                if i == 1 and self.fail_after_first is not None:
                    async with rpc_errors(context, "Generate"):
                        raise Unavailable(self.fail_after_first)
                last = i == self.tokens - 1
                yield generate_pb2.GenerateResponse(
                    tokens=[generate_pb2.GeneratedToken(token_id=100 + i)],
                    finish_reason="length" if last else None,
                    prompt_tokens=len(request.prompt_ids) if i == 0 else 0,
                    queue_ns=1000 if i == 0 else 0)
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            self.cancelled.set()
            raise
        finally:
            self.active -= 1


@dataclass
class Worker:
    name: str
    fake: FakeWorker
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Harness:
    server: RouterServer
    port: int
    stub: router_pb2_grpc.RouterStub
    channel: grpc.aio.Channel
    workers: dict[str, Worker] = field(default_factory=dict)

    async def add_worker(self, name: str, register: bool = True, **fake: Any) -> Worker:
        w = await start_worker(name, **fake)
        self.workers[name] = w
        if register:
            await self.register(name, w.address)
        return w

    async def register(self, name: str, address: str, kind: int = DENSE, **extra: Any) -> None:
        await self.stub.Register(router_pb2.RegisterRequest(kind=kind, member_id=name, address=address,  # type: ignore[arg-type]
                                                            **extra), timeout=2)

    async def heartbeat(self, name: str, **load: Any) -> bool:
        req = router_pb2.HeartbeatRequest(member_id=name)
        if load:
            req.load.CopyFrom(dense_worker_pb2.WorkerLoad(**load))
        return (await self.stub.Heartbeat(req, timeout=2)).known

    def generate(self, prompt: list[int], session: str | None = None, timeout: float = 10,
                 request_id: str = "r") -> grpc.aio.UnaryStreamCall:
        req = generate_pb2.GenerateRequest(request_id=request_id, prompt_ids=prompt,
                                           sampling=generate_pb2.SamplingParams(max_tokens=3))
        if session is not None:
            req.session_id = session
        return self.stub.Generate(req, timeout=timeout)

    async def run(self, prompt: list[int], session: str | None = None) -> list[generate_pb2.GenerateResponse]:
        return await drain(self.generate(prompt, session))

    async def status(self) -> router_pb2.ClusterStatusResponse:
        return await self.stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=2)

    def metric(self, name: str, **labels: str) -> float:
        return self.server.core.metrics.registry.get_sample_value(name, labels) or 0.0


async def drain(call: grpc.aio.UnaryStreamCall) -> list[generate_pb2.GenerateResponse]:
    """The rest of a stream (read() style: it cannot be mixed with async iteration)."""
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def start_worker(name: str, **fake: Any) -> Worker:
    fw = FakeWorker(**fake)
    server = grpc.aio.server()
    dense_worker_pb2_grpc.add_DenseWorkerServicer_to_server(fw, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Worker(name, fw, server, port)


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    made: list[Harness] = []

    async def make(**settings: Any) -> Harness:
        server, port = create_server(router_settings(**settings))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        h = Harness(server, port, router_pb2_grpc.RouterStub(channel), channel)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.channel.close()
        await h.server.stop(0)
        for w in h.workers.values():
            await w.server.stop(0)


@pytest.fixture
async def router(make_router: Callable[..., Awaitable[Harness]]) -> Harness:
    return await make_router()


# -- health, registry ---------------------------------------------------------------------


async def test_health_serving(router: Harness) -> None:
    health = health_pb2_grpc.HealthStub(router.channel)
    for service in ("", SERVICE_NAME):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_register_heartbeat_expiry(make_router: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_router(member_expiry_s=0.3)
    resp = await h.stub.Register(router_pb2.RegisterRequest(kind=DENSE, member_id="w1", address="127.0.0.1:1"),
                                 timeout=2)
    assert resp.heartbeat_interval_s == pytest.approx(0.1) and resp.expiry_s == pytest.approx(0.3)
    await h.register("w1", "127.0.0.1:1")  # idempotent
    assert [m.member_id for m in (await h.status()).members] == ["w1"]
    assert await h.heartbeat("w1", running=1, max_batch=4)
    assert not await h.heartbeat("nobody")
    # Heartbeats keep it; silence expires it.
    for _ in range(5):
        await asyncio.sleep(0.1)
        assert await h.heartbeat("w1")
    assert len((await h.status()).members) == 1
    await asyncio.sleep(0.6)
    assert (await h.status()).members == []
    assert not await h.heartbeat("w1")
    assert h.metric("moetier_router_member_departures_total", reason="expired") == 1


def test_a_router_that_stalled_does_not_expire_the_members_it_could_not_hear() -> None:
    """Registry.sweep (the expiry task's round): a member silent for expiry_s leaves; but where the
    router's own loop did not run (a round due after 1 s ran 20 s later), that time is not counted
    against the members, and one that stays silent afterwards leaves expiry_s later."""
    now = [0.0]
    reg = Registry(1.0, 5.0, clock=lambda: now[0])
    info = MemberInfo(MemberKind.DENSE_WORKER, "w1", "127.0.0.1:1", "", "m", ())
    reg.register(info)
    for t in (1.0, 2.0):  # rounds on time, heard from at 2
        now[0] = t
        assert reg.sweep(1.0) == []
    assert reg.heartbeat("w1", None)
    now[0] = 22.0  # the router stalled for 19 s past its next round
    assert reg.sweep(1.0) == [] and reg.get("w1") is not None
    for t in (23.0, 24.0, 25.0, 26.0):  # silent since the router runs again, under expiry_s
        now[0] = t
        assert reg.sweep(1.0) == []
    now[0] = 27.5
    assert reg.sweep(1.0) == ["w1"]  # 6.5 s of silence the router was there to hear (1 before its stall)
    reg.register(info)
    for t in (28.5, 29.5, 30.5, 31.5, 32.5, 33.5):  # no stall: silence expires it as always
        now[0] = t
        gone = reg.sweep(1.0)
    assert gone == ["w1"]


async def test_reregister_with_new_address_replaces(router: Harness) -> None:
    await router.register("w1", "127.0.0.1:1")
    await router.register("w1", "127.0.0.1:2")
    members = (await router.status()).members
    assert [(m.member_id, m.address) for m in members] == [("w1", "127.0.0.1:2")]


async def test_register_rejects_bad_requests(router: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.register("", "127.0.0.1:1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.register("w", "127.0.0.1:1", kind=router_pb2.MEMBER_KIND_UNSPECIFIED)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cluster_status_content(router: Harness) -> None:
    worker = await router.add_worker("w1", register=False, tokens=3)
    worker.fake.gate = asyncio.Event()
    await router.register("w1", worker.address, metrics_address="127.0.0.1:9102", model_id="m1")
    await router.register("s1", "127.0.0.1:7", kind=STORE, model_id="m1",
                          owned=[router_pb2.ExpertRange(layer=1, first=0, last=32)])
    await router.heartbeat("w1", running=2, waiting=1, kv_bytes=4096, max_batch=8, max_waiting=4,
                           prefix_hashes=[1, 2, 3], prefix_block=16)
    call = router.generate([1, 2, 3])
    await call.read()
    st = await router.status()
    assert st.queued == 0 and st.queue_capacity == 8
    by_id = {m.member_id: m for m in st.members}
    w1, s1 = by_id["w1"], by_id["s1"]
    assert (w1.kind, w1.address, w1.metrics_address, w1.model_id) == (DENSE, worker.address, "127.0.0.1:9102", "m1")
    assert w1.in_flight == 1 and 0 <= w1.last_seen_s < 1
    assert (w1.load.running, w1.load.waiting, w1.load.kv_bytes, w1.load.max_batch) == (2, 1, 4096, 8)
    assert list(w1.load.prefix_hashes) == []  # routing input, not status
    assert s1.kind == STORE and not s1.HasField("load") and s1.in_flight == 0
    assert [(r.layer, r.first, r.last) for r in s1.owned] == [(1, 0, 32)]
    worker.fake.gate.set()
    assert len(await drain(call)) == 2


# -- generation, routing --------------------------------------------------------------------


async def test_no_workers_is_unavailable(router: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.run([1, 2, 3])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no dense worker" in (e.value.details() or "")
    assert router.metric("moetier_router_requests_total", outcome="unavailable") == 1


async def test_empty_prompt_is_invalid(router: Harness) -> None:
    await router.add_worker("w1")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.run([])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_relays_stream_with_worker_id_queue_time_and_deadline(router: Harness) -> None:
    w = await router.add_worker("w1", tokens=4)
    msgs = await drain(router.generate(list(range(40)), timeout=5))
    assert [t.token_id for m in msgs for t in m.tokens] == [100, 101, 102, 103]
    assert msgs[0].worker_id == "w1" and msgs[0].queue_ns >= 1000 and msgs[0].prompt_tokens == 40
    assert all(m.worker_id == "" for m in msgs[1:])
    assert msgs[-1].finish_reason == "length"
    assert list(w.fake.requests[0].prompt_ids) == list(range(40))
    deadline = w.fake.deadlines[0]
    assert deadline is not None and 3 < deadline <= 5.1  # the caller's deadline, passed on
    assert router.metric("moetier_router_requests_total", outcome="ok") == 1
    assert (await router.status()).members[0].in_flight == 0


async def test_prefix_reported_by_worker_wins(router: Harness) -> None:
    await router.add_worker("a")
    await router.add_worker("b")
    turn1 = list(range(1, 50))
    turn2 = [*turn1, 7, 8, 9, *range(60, 80)]
    await router.heartbeat("b", max_batch=4, prefix_hashes=block_hashes(turn1, 16), prefix_block=16)
    msgs = await router.run(turn2)
    assert msgs[0].worker_id == "b"
    assert router.metric("moetier_router_routed_total", reason="prefix") == 1


async def test_least_load_then_router_memory_of_prefixes(router: Harness) -> None:
    a = await router.add_worker("a")
    b = await router.add_worker("b")
    a.fake.gate, b.fake.gate = asyncio.Event(), asyncio.Event()
    hold_a = router.generate(list(range(500, 540)))  # tie: goes to "a" and stays
    assert (await hold_a.read()).worker_id == "a"
    b.fake.gate.set()
    turn1 = list(range(1, 50))
    assert (await router.run(turn1))[0].worker_id == "b"  # least load
    b.fake.gate.clear()
    hold_b = router.generate(list(range(600, 640)))  # least load again: "b"
    assert (await hold_b.read()).worker_id == "b"
    # Both hold one request; the load tie would pick "a", the router remembers turn1 on "b".
    b.fake.gate.set()
    assert (await router.run([*turn1, 9, 9, 9]))[0].worker_id == "b"
    assert router.metric("moetier_router_routed_total", reason="prefix") == 1
    assert router.metric("moetier_router_routed_total", reason="least_load") == 3
    a.fake.gate.set()
    assert len(await drain(hold_a)) == 2 and len(await drain(hold_b)) == 2


async def test_session_affinity(router: Harness) -> None:
    a = await router.add_worker("a")
    await router.add_worker("b")
    a.fake.gate = asyncio.Event()
    first = router.generate([1, 2, 3], session="chat-1")
    assert (await first.read()).worker_id == "a"
    # "a" is busier, the prompt shares nothing: the session still goes to "a".
    a.fake.gate.set()
    assert (await router.run([9, 9, 9], session="chat-1"))[0].worker_id == "a"
    assert router.metric("moetier_router_routed_total", reason="session") == 1
    assert (await router.run([9, 9, 9], session="chat-2"))[0].worker_id in ("a", "b")
    assert len(await drain(first)) == 2


async def test_affinity_yields_when_its_batch_is_full(router: Harness) -> None:
    a = await router.add_worker("a")
    await router.add_worker("b")
    await router.heartbeat("a", max_batch=1, max_waiting=4)
    a.fake.gate = asyncio.Event()
    first = router.generate([1, 2, 3], session="chat-1")
    assert (await first.read()).worker_id == "a"
    # "a" would queue it behind a full batch while "b" can start it now.
    assert (await router.run([1, 2, 3, 4], session="chat-1"))[0].worker_id == "b"
    a.fake.gate.set()
    assert len(await drain(first)) == 2


async def test_queue_overflow_is_resource_exhausted_with_retry_hint(
        make_router: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_router(queue_capacity=1)
    w = await h.add_worker("w1")
    await h.heartbeat("w1", max_batch=1, max_waiting=0)
    w.fake.gate = asyncio.Event()
    running = h.generate([1], request_id="running")
    await running.read()
    queued = h.generate([2], request_id="queued")
    await eventually(lambda: _queued_is(h, 1))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.run([3])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = dict(e.value.trailing_metadata() or ())[RETRY_AFTER_KEY]
    assert 100 <= int(retry) <= 30_000
    assert h.metric("moetier_router_requests_total", outcome="rejected") == 1
    assert len(w.fake.requests) == 1  # the worker never saw more than its capacity
    w.fake.gate.set()
    assert len(await drain(running)) == 2
    msgs = await drain(queued)
    assert msgs[0].worker_id == "w1" and msgs[0].queue_ns > 1000
    assert (await h.status()).queued == 0
    assert h.metric("moetier_router_queue_time_seconds_count") == 2


async def _queued_is(h: Harness, n: int) -> bool:
    return (await h.status()).queued == n


async def test_caller_cancel_reaches_worker_and_frees_slot(router: Harness) -> None:
    w = await router.add_worker("w1", tokens=1000, delay_s=0.02)
    await router.heartbeat("w1", max_batch=1, max_waiting=0)
    call = router.generate([1, 2, 3])
    await call.read()
    await call.read()
    waiting = router.generate([4, 5, 6], request_id="next")  # queued behind the first
    await eventually(lambda: _queued_is(router, 1))
    cancelled_at = time.monotonic()
    call.cancel()
    await asyncio.wait_for(w.fake.cancelled.wait(), 1)
    assert w.fake.cancelled_at - cancelled_at < 0.1
    # Its slot went to the queued request.
    assert (await waiting.read()).worker_id == "w1"
    waiting.cancel()
    await eventually(lambda: _in_flight_is(router, 0))
    assert router.metric("moetier_router_requests_total", outcome="cancelled") == 2


async def _in_flight_is(h: Harness, n: int) -> bool:
    return sum(m.in_flight for m in (await h.status()).members) == n


async def test_cancel_while_queued_leaves_the_queue(router: Harness) -> None:
    w = await router.add_worker("w1")
    await router.heartbeat("w1", max_batch=1, max_waiting=0)
    w.fake.gate = asyncio.Event()
    running = router.generate([1])
    await running.read()
    queued = router.generate([2])
    await eventually(lambda: _queued_is(router, 1))
    queued.cancel()
    await eventually(lambda: _queued_is(router, 0))
    w.fake.gate.set()
    assert len(await drain(running)) == 2
    assert len(w.fake.requests) == 1


async def test_a_worker_that_fails_a_request_itself_stays_in_the_table(router: Harness) -> None:
    """UNAVAILABLE from the worker's own servicer (the request's experts have no live store) is the
    request's error, not the worker's death: the caller gets the message, the worker stays."""
    await router.add_worker("a", fail_after_first="layer 1: no live expert store holds experts [5]")
    call = router.generate([1, 2, 3])
    assert (await call.read()).worker_id == "a"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await drain(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "layer 1: no live expert store holds experts [5]" in (e.value.details() or "")
    assert [m.member_id for m in (await router.status()).members] == ["a"]
    assert router.metric("moetier_router_member_departures_total", reason="failed") == 0


async def test_worker_killed_mid_stream_fails_fast_and_leaves_table(router: Harness) -> None:
    a = await router.add_worker("a", tokens=1000, delay_s=0.02)
    call = router.generate([1, 2, 3])
    assert (await call.read()).worker_id == "a"
    killed_at = time.monotonic()
    await a.server.stop(None)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await drain(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed_at < 1.0
    assert (await router.status()).members == []
    assert router.metric("moetier_router_member_departures_total", reason="failed") == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await router.run([1, 2, 3])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await router.add_worker("b")
    assert (await router.run([1, 2, 3]))[0].worker_id == "b"


async def test_worker_failing_before_first_token_is_routed_around(router: Harness) -> None:
    with contextlib.closing(socket.socket()) as s:  # an address where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    await router.register("a", dead)  # wins the load tie
    await router.add_worker("b")
    msgs = await router.run([1, 2, 3])
    assert msgs[0].worker_id == "b" and len(msgs) == 3
    assert [m.member_id for m in (await router.status()).members] == ["b"]
    assert router.metric("moetier_router_failovers_total") == 1
    assert router.metric("moetier_router_requests_total", outcome="ok") == 1


async def test_expired_worker_fails_its_streams_and_queue(make_router: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_router(member_expiry_s=0.3)
    w = await h.add_worker("w1")
    await h.heartbeat("w1", max_batch=1, max_waiting=0)
    w.fake.gate = asyncio.Event()  # a frozen worker: connected, silent
    running = h.generate([1])
    await running.read()
    queued = h.generate([2])
    started = time.monotonic()
    for call in (running, queued):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 1.5


async def test_worker_resource_exhausted_passes_through(router: Harness) -> None:
    class Full(FakeWorker):
        async def Generate(self, request: generate_pb2.GenerateRequest,  # type: ignore[override]
                           context: grpc.aio.ServicerContext) -> None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, "2500"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "batch full")

    server = grpc.aio.server()
    dense_worker_pb2_grpc.add_DenseWorkerServicer_to_server(Full(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await router.register("full", f"127.0.0.1:{port}")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.run([1])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata() or ())[RETRY_AFTER_KEY] == "2500"
        assert [m.member_id for m in (await router.status()).members] == ["full"]  # not a failure
    finally:
        await server.stop(0)


async def test_metrics_endpoint(make_router: Callable[..., Awaitable[Harness]]) -> None:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = await make_router(router={"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": port,
                                  "id": "router"})
    await h.add_worker("w1")
    await h.run([1, 2])
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())
    for line in ('moetier_router_requests_total{outcome="ok"} 1.0', 'moetier_router_members{kind="dense_worker"} 1.0',
                 'moetier_router_routed_total{reason="least_load"} 1.0', "moetier_router_queue_depth 0.0",
                 "moetier_router_in_flight 0.0", "moetier_router_queue_time_seconds_count 1.0",
                 "moetier_router_queue_capacity 8.0"):
        assert line in text, line


async def test_mixed_load_leaves_nothing_behind(make_router: Callable[..., Awaitable[Harness]]) -> None:
    """40 callers, 2 workers of 2 slots, a queue of 8: some finish, some are refused, some give
    up; afterwards no slot, queue entry or worker stream is left over."""
    h = await make_router(queue_capacity=8)
    workers = [await h.add_worker(n, tokens=5, delay_s=0.01) for n in ("a", "b")]
    for n in ("a", "b"):
        await h.heartbeat(n, max_batch=1, max_waiting=1)

    async def caller(i: int) -> str:
        call = h.generate([i % 7 + 1] * 20, session=f"s{i % 5}", request_id=f"r{i}")
        try:
            if i % 4 == 3:
                await asyncio.sleep(0.02)
                call.cancel()
                return "cancelled"
            await drain(call)
            return "ok"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    results = await asyncio.gather(*(caller(i) for i in range(40)))
    assert set(results) <= {"ok", "cancelled", "RESOURCE_EXHAUSTED"}
    assert results.count("ok") >= 4 and "RESOURCE_EXHAUSTED" in results
    await eventually(lambda: _in_flight_is(h, 0))
    assert (await h.status()).queued == 0

    async def workers_idle() -> bool:
        return all(w.fake.active == 0 for w in workers)

    await eventually(workers_idle)
    served = sum(len(w.fake.requests) for w in workers)
    assert served <= 40 - results.count("RESOURCE_EXHAUSTED")
