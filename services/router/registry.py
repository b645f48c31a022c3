"""Cluster membership: who is registered, when they were last heard from, their load.

Members (dense workers and expert stores) Register, then Heartbeat every
`heartbeat_interval_s`; one silent for `expiry_s` is dropped by the expiry task.
A member that fails mid-stream is dropped at once (`remove(..., "failed")`) and
comes back by registering again (its MemberAgent does so when a heartbeat is
answered `known=false`). A member shutting down says so in a heartbeat (`draining`) and
leaves at once (`remove(..., "drained")`). Listeners hear every join, heartbeat and leave, synchronously,
on the event loop: the scheduler to place queued requests, the channel pool to
close channels of members that are gone.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from moetier.placement import ExpertRange

log = logging.getLogger(__name__)


class MemberKind(enum.Enum):
    DENSE_WORKER = "dense_worker"
    EXPERT_STORE = "expert_store"


@dataclass(frozen=True)
class LoadReport:
    """A dense worker's own view of its load, from its latest heartbeat."""

    running: int
    waiting: int
    kv_bytes: int
    max_batch: int
    max_waiting: int
    # Chained block hashes (moetier.prefix) of the prefixes it holds, and their block size.
    prefix_hashes: set[int]
    prefix_block: int


@dataclass(frozen=True)
class MemberInfo:
    """What a member says about itself when it registers."""

    kind: MemberKind
    member_id: str
    address: str
    metrics_address: str
    model_id: str
    owned: tuple[ExpertRange, ...]
    read_bandwidth: float = 0.0  # an expert store's measured read bandwidth, bytes/s (0: unknown)


@dataclass(frozen=True, eq=False)  # identity: one object per (re)registration or heartbeat
class Member:
    info: MemberInfo
    last_seen: float  # registry clock (monotonic seconds)
    load: LoadReport | None = None

    @property
    def member_id(self) -> str:
        return self.info.member_id


LeaveReason = Literal["expired", "failed", "replaced", "drained"]
# (member, None) when a member joins or heartbeats (its load may have changed);
# (member, reason) when it leaves.
Listener = Callable[[Member, LeaveReason | None], None]


class Registry:
    def __init__(self, heartbeat_interval_s: float, expiry_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.expiry_s = expiry_s
        self._clock = clock
        self._last_sweep: float | None = None  # when the expiry task last ran (sweep)
        self._members: dict[str, Member] = {}
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, member: Member, reason: LeaveReason | None) -> None:
        for listener in self._listeners:
            listener(member, reason)

    def register(self, info: MemberInfo) -> Member:
        """Idempotent by member_id; a new address (or kind) replaces the old member."""
        old = self._members.get(info.member_id)
        now = self._clock()
        if old is not None and (old.info.address, old.info.kind) == (info.address, info.kind):
            member = replace(old, info=info, last_seen=now)
            self._members[info.member_id] = member
            if old.info != info:  # same member, new facts (a store's shard or bandwidth)
                self._emit(member, None)
            return member
        if old is not None:
            del self._members[info.member_id]
            log.info("member %s moved from %s to %s", info.member_id, old.info.address, info.address)
            self._emit(old, "replaced")
        member = Member(info=info, last_seen=now)
        self._members[info.member_id] = member
        log.info("member %s joined (%s at %s)", info.member_id, info.kind.value, info.address)
        self._emit(member, None)
        return member

    def heartbeat(self, member_id: str, load: LoadReport | None) -> bool:
        """Record a heartbeat; False when the member is unknown (it must register again)."""
        old = self._members.get(member_id)
        if old is None:
            return False
        self._members[member_id] = replace(old, last_seen=self._clock(), load=load or old.load)
        # A load report can free admission slots: tell the listeners the member is (still) here.
        self._emit(self._members[member_id], None)
        return True

    def remove(self, member_id: str, reason: LeaveReason) -> bool:
        member = self._members.pop(member_id, None)
        if member is None:
            return False
        log.warning("member %s left the routing table (%s)", member_id, reason)
        self._emit(member, reason)
        return True

    def get(self, member_id: str) -> Member | None:
        return self._members.get(member_id)

    def members(self, kind: MemberKind | None = None) -> list[Member]:
        return [m for m in self._members.values() if kind is None or m.info.kind is kind]

    def count(self, kind: MemberKind) -> int:
        # Also read by the metrics thread: iterate over a snapshot (list() is atomic).
        return sum(1 for m in list(self._members.values()) if m.info.kind is kind)

    def seconds_since_seen(self, member: Member) -> float:
        return max(0.0, self._clock() - member.last_seen)

    def expire(self) -> list[str]:
        """Drop members silent for expiry_s; their ids."""
        cutoff = self._clock() - self.expiry_s
        gone = [m.member_id for m in self._members.values() if m.last_seen < cutoff]
        for member_id in gone:
            self.remove(member_id, "expired")
        return gone

    def sweep(self, period: float) -> list[str]:
        """One round of the expiry task, due `period` after the last: `expire`, except that time
        the router itself lost -- a round later than due by more than a period, its event loop
        stalled (a host starved of CPU or of memory: every process of a capped cluster stalls in
        reclaim at once) -- is not counted against the members, whose heartbeats it could not
        answer meanwhile. A member that stays silent after the router runs again leaves as
        usual, that much later. Returns the ids that left."""
        now = self._clock()
        last, self._last_sweep = self._last_sweep, now
        lost = 0.0 if last is None else now - last - period
        if lost > period and self._members:
            log.warning("the router did not run for %.1f s: its members' silence meanwhile is not counted", lost)
            for member_id, m in list(self._members.items()):
                self._members[member_id] = replace(m, last_seen=min(now, m.last_seen + lost))
        return self.expire()

    async def run_expiry(self) -> None:
        """The expiry task: checks often enough that a member leaves within ~1.25 x expiry_s."""
        period = min(self.heartbeat_interval_s, self.expiry_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep(period)
