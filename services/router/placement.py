"""The placement map the router publishes: every live expert store, what it owns, its weight.

Rebuilt when a store joins, leaves (expired, failed, drained, replaced) or registers again
with another shard or bandwidth; each rebuild gets a new version, which dense workers poll
for (`Router.Placement`). Heartbeats that change nothing leave the map (and its version) as
it is. Which store computes an expert is decided from the map by `moetier.placement`, the
same function the workers run, so the per-store counts shown here are the workers' routing.
"""

from __future__ import annotations

import secrets

from moetier.placement import PlacementMap, from_ranges
from services.router.registry import LeaveReason, Member, MemberKind, Registry

_Key = tuple[tuple[str, str, float, tuple[object, ...]], ...]


class Placements:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._key: _Key = ()
        # Versions start at a random point: a worker that asks a restarted router with the version
        # it held before gets the new map, not "unchanged" from a count that started over.
        self.version = secrets.randbits(40) << 16
        self.map = PlacementMap([], self.version)
        self.placed: dict[str, int] = {}  # member_id -> experts the map sends to it first
        self.unowned_keys = 0  # experts a departed store held that no live store owns (of those ever seen)
        self._seen: set[tuple[int, int]] = set()  # every expert some store has owned
        registry.add_listener(self._on_member)

    def _on_member(self, member: Member, left: LeaveReason | None) -> None:
        if member.info.kind is MemberKind.EXPERT_STORE:
            self.refresh()

    def refresh(self) -> None:
        stores = sorted(self._registry.members(MemberKind.EXPERT_STORE), key=lambda m: m.member_id)
        key: _Key = tuple((m.member_id, m.info.address, m.info.read_bandwidth, m.info.owned) for m in stores)
        if key == self._key:
            return
        self._key = key
        self.version += 1
        self.map = PlacementMap.weighted([(m.member_id, m.info.address, m.info.read_bandwidth, m.info.owned)
                                          for m in stores], self.version)
        owned = [from_ranges(m.info.owned) for m in stores]
        everything = set().union(*owned) if owned else set()
        self._seen |= everything
        counts = {m.member_id: 0 for m in stores}
        for layer, e in everything:
            i = self.map.owner((layer, e))
            if i is not None:
                counts[self.map.stores[i].member_id] += 1
        self.placed = counts
        self.unowned_keys = 0 if any(not m.info.owned for m in stores) else len(self._seen - everything)
