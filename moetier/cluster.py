"""Cluster membership, member side: register with the router and keep heartbeating.

A dense worker or expert store owns one MemberAgent:

    agent = MemberAgent.from_settings(settings, "dense_worker", model_id=mid, load=engine.load_pb)
    agent.start()
    ...
    await agent.stop()

The agent never fails its member: while the router is down it retries with capped,
jittered backoff; when the router answers a heartbeat with `known=false` (it restarted,
or dropped the member) it registers again at once. Every call carries a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import grpc

from moetier.rpc.channels import RECONNECT_OPTIONS
from moetier.rpc.v1 import dense_worker_pb2, router_pb2, router_pb2_grpc
from moetier.settings import Settings

log = logging.getLogger(__name__)

Kind = Literal["dense_worker", "expert_store"]
LoadFn = Callable[[], dense_worker_pb2.WorkerLoad | Awaitable[dense_worker_pb2.WorkerLoad]]

_KIND_PB = {"dense_worker": router_pb2.MEMBER_KIND_DENSE_WORKER,
            "expert_store": router_pb2.MEMBER_KIND_EXPERT_STORE}


class MemberAgent:
    def __init__(self, router_address: str, kind: Kind, member_id: str, address: str, *,
                 metrics_address: str = "", model_id: str = "",
                 owned: Sequence[tuple[int, int, int]] = (), load: LoadFn | None = None,
                 heartbeat_interval_s: float = 1.0, rpc_timeout_s: float = 2.0,
                 backoff_s: tuple[float, float] = (0.05, 2.0), read_bandwidth: float = 0.0,
                 drain_on_stop: bool = False) -> None:
        """`owned`: (layer, first, last) expert ranges of a store (empty: all), `read_bandwidth`
        its measured bytes/s. `load`: what a dense worker reports with each heartbeat. The
        interval is the router's once it has answered a Register; `heartbeat_interval_s` is
        used until then. drain_on_stop: `stop()` tells the router first (a draining
        heartbeat), so the member leaves its tables at once instead of expiring."""
        self.router_address = router_address
        self.member_id = member_id
        self._register_req = router_pb2.RegisterRequest(
            kind=_KIND_PB[kind], member_id=member_id, address=address, metrics_address=metrics_address,
            model_id=model_id, owned=[router_pb2.ExpertRange(layer=l_, first=f, last=e) for l_, f, e in owned],
            read_bandwidth=read_bandwidth)
        self._drain_on_stop = drain_on_stop
        self._load = load
        self.heartbeat_interval_s = heartbeat_interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff_s = backoff_s
        self._task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()  # set while the router knows this member
        self.registrations = 0  # successful Register calls (the first and every re-registration)

    @classmethod
    def from_settings(cls, settings: Settings, kind: Kind, *, model_id: str = "",
                      owned: Sequence[tuple[int, int, int]] = (), load: LoadFn | None = None,
                      read_bandwidth: float = 0.0, drain_on_stop: bool = False) -> MemberAgent:
        ep = settings.dense_worker if kind == "dense_worker" else settings.expert_store
        host = ep.address.rsplit(":", 1)[0]
        return cls(settings.router.address, kind, ep.id, ep.address,
                   metrics_address=f"{host}:{ep.metrics_port}" if ep.metrics_port else "",
                   model_id=model_id, owned=owned, load=load,
                   heartbeat_interval_s=settings.heartbeat_interval_s, read_bandwidth=read_bandwidth,
                   drain_on_stop=drain_on_stop)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"member-agent {self.member_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            if self._drain_on_stop and self.registered.is_set():
                await self._drain()

    async def _drain(self) -> None:
        """Best effort, one short call: a router that does not answer expires the member instead."""
        self.registered.clear()
        try:
            async with grpc.aio.insecure_channel(self.router_address, options=RECONNECT_OPTIONS) as channel:
                await router_pb2_grpc.RouterStub(channel).Heartbeat(
                    router_pb2.HeartbeatRequest(member_id=self.member_id, draining=True),
                    timeout=min(self._rpc_timeout_s, 1.0))
            log.info("%s drained from router %s", self.member_id, self.router_address)
        except grpc.aio.AioRpcError as e:
            log.info("%s: router %s did not take the drain (%s); it expires the member", self.member_id,
                     self.router_address, e.code().name)

    async def run(self) -> None:
        """Register, heartbeat, re-register, retry: until cancelled."""
        async with grpc.aio.insecure_channel(self.router_address, options=RECONNECT_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            delay = self._backoff_s[0]
            failing = False
            while True:
                try:
                    if not self.registered.is_set():
                        await self._register(stub)
                    await asyncio.sleep(self.heartbeat_interval_s)
                    if not await self._heartbeat(stub):
                        log.info("router %s does not know %s; registering again", self.router_address,
                                 self.member_id)
                        self.registered.clear()
                        continue
                    delay, failing = self._backoff_s[0], False
                except Exception as e:
                    # Router down, restarting or misbehaving: the member keeps serving and retries.
                    self.registered.clear()
                    why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                    log.log(logging.DEBUG if failing else logging.WARNING,
                            "router %s unreachable from %s (%s); retrying", self.router_address,
                            self.member_id, why)
                    failing = True
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(self._backoff_s[1], delay * 2)

    async def _register(self, stub: router_pb2_grpc.RouterStub) -> None:
        resp = await stub.Register(self._register_req, timeout=self._rpc_timeout_s)
        if resp.heartbeat_interval_s > 0:
            self.heartbeat_interval_s = resp.heartbeat_interval_s
        self.registrations += 1
        self.registered.set()
        log.info("%s registered with router %s", self.member_id, self.router_address)

    async def _heartbeat(self, stub: router_pb2_grpc.RouterStub) -> bool:
        req = router_pb2.HeartbeatRequest(member_id=self.member_id)
        if self._load is not None:
            try:
                load = self._load()
                req.load.CopyFrom(await load if inspect.isawaitable(load) else load)
            except Exception:
                # A broken load report must not cost the member its membership.
                log.exception("%s: load report failed; heartbeating without it", self.member_id)
        resp = await stub.Heartbeat(req, timeout=self._rpc_timeout_s)
        return bool(resp.known)
