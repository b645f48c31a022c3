"""The router's domain: registry + scheduler + worker channels + metrics, wired together.

The servicer converts and delegates here; nothing in this module sees a servicer context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from moetier.errors import InvalidArgument, ResourceExhausted, Unavailable
from moetier.placement import PlacementMap
from moetier.rpc.v1 import generate_pb2
from moetier.settings import Settings
from moetier.testhooks import OffsetClock
from services.router.metrics import RouterMetrics
from services.router.placement import Placements
from services.router.registry import LeaveReason, LoadReport, Member, MemberInfo, MemberKind, Registry
from services.router.scheduler import Lease, Route, Scheduler
from services.router.workers import WorkerClients, WorkerGone

log = logging.getLogger(__name__)

# Tries of a request whose worker fails before its first token (each on another worker).
_ATTEMPTS = 3


@dataclass(frozen=True)
class MemberStatus:
    member: Member
    last_seen_s: float
    in_flight: int
    placed_experts: int = 0


@dataclass(frozen=True)
class ClusterView:
    members: list[MemberStatus]
    queued: int
    queue_capacity: int


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    if isinstance(exc, ResourceExhausted):
        return "rejected"
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, InvalidArgument):
        return "invalid"
    return "error"


class RouterCore:
    def __init__(self, settings: Settings) -> None:
        clock = OffsetClock(settings.test_clock_offset_file) if settings.test_clock_offset_file else time.monotonic
        self.registry = Registry(settings.heartbeat_interval_s, settings.member_expiry_s, clock)
        self.scheduler = Scheduler(self.registry, settings.queue_capacity,
                                   default_max_batch=settings.inference.max_batch_size,
                                   default_max_waiting=settings.inference.max_waiting)
        self.workers = WorkerClients(self.registry)
        self.placements = Placements(self.registry)
        # No generation outlives the gateway's own deadline for it: that is the longest a
        # worker call may run when the caller set no deadline of its own.
        self.max_request_s = settings.gateway.request_timeout_s
        self.metrics = RouterMetrics()
        self.metrics.observe_state(lambda: self.scheduler.queued, self.scheduler.queue_capacity,
                                   lambda: self.scheduler.in_flight_total, self.registry.count)
        self.metrics.observe_placement(lambda: self.placements.placed, lambda: self.placements.unowned_keys,
                                       lambda: self.placements.version)
        self.registry.add_listener(self._count_departure)
        self._expiry: asyncio.Task[None] | None = None

    def _count_departure(self, member: Member, left: LeaveReason | None) -> None:
        if left is not None:
            self.metrics.departures.labels(reason=left).inc()

    async def start(self) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self.registry.run_expiry())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.workers.close()

    # -- membership --------------------------------------------------------------------

    def register(self, info: MemberInfo) -> None:
        self.registry.register(info)

    def heartbeat(self, member_id: str, load: LoadReport | None, draining: bool = False) -> bool:
        if draining:  # leaves the table and the placement map now; a later Register brings it back
            self.registry.remove(member_id, "drained")
            return True
        return self.registry.heartbeat(member_id, load)

    def placement(self, known_version: int | None) -> tuple[int, PlacementMap | None]:
        """(version, the map; None when the caller holds this version already)."""
        p = self.placements
        return p.version, None if known_version == p.version else p.map

    def status(self) -> ClusterView:
        members = sorted(self.registry.members(), key=lambda m: (m.info.kind.value, m.member_id))
        return ClusterView(
            members=[MemberStatus(m, self.registry.seconds_since_seen(m), self.scheduler.in_flight(m.member_id),
                                  self.placements.placed.get(m.member_id, 0)) for m in members],
            queued=self.scheduler.queued, queue_capacity=self.scheduler.queue_capacity)

    # -- generation --------------------------------------------------------------------

    async def generate(self, route: Route, request: generate_pb2.GenerateRequest,
                       time_remaining_s: float | None) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """Queue, route and relay one request. `time_remaining_s`: the caller's deadline.

        A worker that fails before relaying anything costs the caller nothing: the worker
        has left the table and the request is routed again (up to _ATTEMPTS times). Once a
        token has been relayed, a failure ends the stream with Unavailable.
        """
        started = time.monotonic()
        budget = self.max_request_s if time_remaining_s is None else min(time_remaining_s, self.max_request_s)
        error: BaseException | None = None
        finished = False  # the worker sent its last message (finish_reason): the request is complete
        try:
            for attempt in range(1, _ATTEMPTS + 1):
                lease = await self._acquire(route, budget - (time.monotonic() - started))
                relayed = False
                try:
                    self.metrics.queue_time.observe(lease.queued_s)
                    self.metrics.routed.labels(reason=lease.reason).inc()
                    log.debug("request %s -> %s (%s, queued %.3f s)", route.request_id, lease.member.member_id,
                              lease.reason, lease.queued_s)
                    remaining = budget - (time.monotonic() - started)
                    async with contextlib.aclosing(self.workers.generate(lease, request, remaining)) as stream:
                        async for msg in stream:
                            relayed = True
                            finished = msg.HasField("finish_reason")
                            yield msg
                    return
                except WorkerGone as e:
                    if relayed or attempt == _ATTEMPTS or not self.registry.count(MemberKind.DENSE_WORKER):
                        raise
                    log.warning("request %s: %s; routing it again", route.request_id, e)
                    self.metrics.failovers.inc()
                finally:
                    lease.release()
        except BaseException as e:
            error = e
            raise
        finally:
            # A caller that closes the stream after the final message has its answer: "ok".
            self.metrics.requests.labels(outcome="ok" if finished else _outcome(error)).inc()
            self.metrics.request_time.observe(time.monotonic() - started)

    async def _acquire(self, route: Route, budget_s: float) -> Lease:
        try:
            async with asyncio.timeout(budget_s):
                return await self.scheduler.acquire(route)
        except TimeoutError:
            raise Unavailable(f"request {route.request_id!r} found no free worker within its deadline "
                              "(router queue)") from None
