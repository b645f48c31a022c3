"""Which dense worker serves a request, and when: affinity, least load, a bounded FIFO.

Choice, for a request that may start now:
1. session affinity: the worker that served the request's session_id last, while it
   is registered;
2. prefix affinity: the worker holding the longest prefix of the prompt, measured in
   block hashes (moetier.prefix) against what each worker reports in its heartbeat
   and what the router itself recently sent where (a bounded LRU memory);
3. otherwise the least loaded worker.
Affinity saves a re-prefill, but not at any price: it is ignored when its worker's
batch is full (the request would wait there) while another worker has a free batch
slot (it would start at once).

Admission: a worker takes up to max_batch + max_waiting of the router's requests (from
its latest heartbeat; settings defaults before one). A request no worker can take
waits in one FIFO of `queue_capacity`; past that it is refused with ResourceExhausted
carrying a retry hint. With no dense worker registered, Unavailable; queued requests
fail with Unavailable too when the last worker leaves.

Load = max(router in-flight, the worker's reported running + waiting): the router's
count is current, the report also covers work the router does not know of, and both
count the router's own requests, so they are not added.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from moetier.errors import ResourceExhausted, Unavailable
from moetier.prefix import BLOCK, block_hashes, shared_blocks
from services.router.registry import LeaveReason, Member, MemberKind, Registry

Reason = Literal["session", "prefix", "least_load"]
K = TypeVar("K")


def _remember(table: OrderedDict[K, str], key: K, value: str, cap: int) -> None:
    """Insert or refresh key in a bounded LRU table."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > cap:
        table.popitem(last=False)


@dataclass
class Route:
    """What routing needs to know of a request."""

    request_id: str
    prompt_ids: np.ndarray  # [T] uint32
    session_id: str | None = None
    _hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict, repr=False)

    def hashes(self, block: int, model_id: str) -> list[int]:
        key = (block, model_id)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.prompt_ids, block, model_id)
        return self._hashes[key]


@dataclass
class Lease:
    """A slot on a worker, held while the request runs there; release() exactly once."""

    member: Member
    reason: Reason
    queued_s: float
    granted_at: float
    _release: Callable[[Lease], None] = field(repr=False)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self)


@dataclass
class _Waiter:
    route: Route
    enqueued_at: float
    future: asyncio.Future[Lease]


class Scheduler:
    def __init__(self, registry: Registry, queue_capacity: int, default_max_batch: int,
                 default_max_waiting: int, memory_entries: int = 1 << 16, session_entries: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self.queue_capacity = queue_capacity
        self._default_max_batch = default_max_batch
        self._default_max_waiting = default_max_waiting
        self._memory_entries = memory_entries
        self._session_entries = session_entries
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self._in_flight: dict[str, int] = {}
        self._memory: OrderedDict[int, str] = OrderedDict()  # prefix block hash -> member_id
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session_id -> member_id
        self._hold_ewma_s = 1.0  # how long a request holds its slot (for the retry hint)
        registry.add_listener(self._on_member)

    # -- state -------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight_total(self) -> int:
        return sum(self._in_flight.values())

    def in_flight(self, member_id: str) -> int:
        return self._in_flight.get(member_id, 0)

    def _max_batch(self, w: Member) -> int:
        return w.load.max_batch if w.load and w.load.max_batch else self._default_max_batch

    def _capacity(self, w: Member) -> int:
        if w.load and w.load.max_batch:
            return w.load.max_batch + w.load.max_waiting
        return self._default_max_batch + self._default_max_waiting

    def _load(self, w: Member) -> int:
        reported = w.load.running + w.load.waiting if w.load else 0
        return max(self.in_flight(w.member_id), reported)

    def retry_after_s(self) -> float:
        """Rough time for the queue to drain: queued x slot hold time / slots."""
        slots = sum(self._capacity(w) for w in self._workers()) or 1
        return min(30.0, max(0.1, self._hold_ewma_s * (len(self._queue) + 1) / slots))

    # -- admission ---------------------------------------------------------------------

    async def acquire(self, route: Route) -> Lease:
        """A slot on the chosen worker, waiting in the FIFO if none is free now."""
        if not self._workers():
            raise Unavailable("no dense worker is registered with the router")
        now = self._clock()
        if not self._queue:
            choice = self._choose(route)
            if choice is not None:
                return self._grant(*choice, route, now)
        if len(self._queue) >= self.queue_capacity:
            raise ResourceExhausted(
                f"router queue is full ({len(self._queue)} requests waiting, "
                f"{len(self._workers())} dense workers busy)", retry_after_s=self.retry_after_s())
        waiter = _Waiter(route, now, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # granted just as the caller went away
            elif waiter in self._queue:
                self._queue.remove(waiter)
            raise

    def _grant(self, member: Member, reason: Reason, route: Route, enqueued_at: float) -> Lease:
        mid = member.member_id
        self._in_flight[mid] = self._in_flight.get(mid, 0) + 1
        if route.session_id:
            _remember(self._sessions, route.session_id, mid, self._session_entries)
        block = member.load.prefix_block if member.load and member.load.prefix_block else BLOCK
        for h in route.hashes(block, member.info.model_id):
            _remember(self._memory, h, mid, self._memory_entries)
        now = self._clock()
        return Lease(member, reason, queued_s=now - enqueued_at, granted_at=now, _release=self._release)

    def _release(self, lease: Lease) -> None:
        mid = lease.member.member_id
        n = self._in_flight.get(mid, 0) - 1
        if n > 0:
            self._in_flight[mid] = n
        else:
            self._in_flight.pop(mid, None)
        self._hold_ewma_s = 0.9 * self._hold_ewma_s + 0.1 * (self._clock() - lease.granted_at)
        self._pump()

    def _pump(self) -> None:
        """Hand free slots to the head of the queue, in order."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.future.done():  # its caller went away; acquire() is unwinding
                self._queue.popleft()
                continue
            choice = self._choose(waiter.route)
            if choice is None:
                return
            self._queue.popleft()
            waiter.future.set_result(self._grant(*choice, waiter.route, waiter.enqueued_at))

    def _on_member(self, member: Member, left: LeaveReason | None) -> None:
        if left is not None and member.info.kind is MemberKind.DENSE_WORKER and not self._workers():
            while self._queue:
                fut = self._queue.popleft().future
                if not fut.done():
                    fut.set_exception(Unavailable("the last dense worker left the router while the "
                                                  "request was queued"))
            return
        self._pump()

    # -- choice ------------------------------------------------------------------------

    def _workers(self) -> list[Member]:
        return self._registry.members(MemberKind.DENSE_WORKER)

    def _choose(self, route: Route) -> tuple[Member, Reason] | None:
        workers = self._workers()
        admitting = [w for w in workers if self.in_flight(w.member_id) < self._capacity(w)]
        if not admitting:
            return None
        preferred = self._affinity(route, workers)
        if preferred is not None:
            target, reason = preferred
            full_batch = self._load(target) >= self._max_batch(target)
            if target in admitting and not (
                    full_batch and any(self._load(w) < self._max_batch(w) for w in admitting)):
                return target, reason
        least = min(admitting, key=lambda w: (self._load(w), self.in_flight(w.member_id),
                                              w.load.kv_bytes if w.load else 0, w.member_id))
        return least, "least_load"

    def _affinity(self, route: Route, workers: list[Member]) -> tuple[Member, Reason] | None:
        if route.session_id:
            mid = self._sessions.get(route.session_id)
            for w in workers:
                if w.member_id == mid:
                    return w, "session"
        best: Member | None = None
        best_tokens = 0
        for w in workers:
            block = w.load.prefix_block if w.load and w.load.prefix_block else BLOCK
            hashes = route.hashes(block, w.info.model_id)
            n = shared_blocks(hashes, w.load.prefix_hashes) if w.load else 0
            for k in range(len(hashes), n, -1):  # chained hashes: one hit covers the whole prefix
                if self._memory.get(hashes[k - 1]) == w.member_id:
                    n = k
                    break
            tokens = n * block
            if tokens > best_tokens or (tokens and tokens == best_tokens and best is not None
                                        and self._load(w) < self._load(best)):
                best, best_tokens = w, tokens
        return (best, "prefix") if best is not None else None
