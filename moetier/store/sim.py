"""Offline cache simulation: a policy's hit rate on a trace, and Belady's optimum.

The model of the tier: a cache of `capacity` equal-size records; each (layer, ids)
entry of a trace is one acquire of the batch union, every expert of which must be
resident at once (the union is pinned while it loads, so it never evicts its own
members). A hit is a demanded expert already resident. No prefetch: this measures
replacement alone.

Belady's MIN (evict the resident expert used furthest in the future) is the
offline optimum under the same rules, the bound every policy is compared with.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from moetier.store.policy import Policy
from moetier.store.trace import Trace
from moetier.weights.index import ExpertKey


def _accesses(trace: Trace) -> list[list[ExpertKey]]:
    return [[(layer, int(e)) for e in np.unique(ids)] for step in trace for layer, ids in step]


def simulate(policy: Policy, trace: Trace, capacity: int) -> tuple[int, int]:
    """(hits, accesses) of `policy` with room for `capacity` experts."""
    resident: set[ExpertKey] = set()
    hits = total = 0
    for keys in _accesses(trace):
        if len(keys) > capacity:
            raise ValueError(f"a layer's batch union of {len(keys)} experts exceeds the cache of {capacity}")
        group = set(keys)
        skip: Callable[[ExpertKey], bool] = group.__contains__
        missing = []
        for k in keys:
            policy.record(k)
            if k in resident:
                hits += 1
            else:
                missing.append(k)
        total += len(keys)
        while len(resident) + len(missing) > capacity:
            v = policy.victim(skip)
            assert v is not None and v in resident, "policy offered a victim that is not resident"
            resident.discard(v)
            policy.remove(v)
        for k in missing:
            resident.add(k)
            policy.insert(k)
    return hits, total


def belady(trace: Trace, capacity: int) -> tuple[int, int]:
    """(hits, accesses) of the offline optimum."""
    groups = _accesses(trace)
    never = len(groups) + 1
    # next_use[g][i]: index of the next group using groups[g][i] after g
    next_use: list[list[int]] = [[] for _ in groups]
    last: dict[ExpertKey, int] = {}
    for g in range(len(groups) - 1, -1, -1):
        next_use[g] = [last.get(k, never) for k in groups[g]]
        for k in groups[g]:
            last[k] = g
    resident: dict[ExpertKey, int] = {}  # key -> its next use
    heap: list[tuple[int, ExpertKey]] = []  # (-next use, key); stale entries skipped
    hits = total = 0
    for g, keys in enumerate(groups):
        group = set(keys)
        missing = [k for k in keys if k not in resident]
        hits += len(keys) - len(missing)
        total += len(keys)
        stash = []
        while len(resident) + len(missing) > capacity:
            nu, k = heapq.heappop(heap)
            if resident.get(k) != -nu:
                continue
            if k in group:
                stash.append((nu, k))
                continue
            del resident[k]
        for e in stash:
            heapq.heappush(heap, e)
        for k, nu in zip(keys, next_use[g], strict=True):
            resident[k] = nu
            heapq.heappush(heap, (-nu, k))
        if len(heap) > 4 * capacity + 64:
            heap = [(-nu, k) for k, nu in resident.items()]
            heapq.heapify(heap)
    return hits, total
