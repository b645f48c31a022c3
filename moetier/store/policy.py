"""Replacement policies of the RAM tier.

A policy orders the resident experts for eviction; the tier owns bytes, pins and
I/O. The same objects drive the tier and the offline simulator (sim.py), so the
hit rates `moetier bench cache` reports are the tier's.

Calls, all under the tier's lock:
    record(key)        a demand access (hit or miss), before the key is resident on a miss
    insert(key)        key entered the tier (its read is queued; the tier never evicts it
                       while the read is in flight or a compute holds it)
    remove(key)        key left the tier (evicted or failed)
    victim(skip)       the next key to evict among resident keys with skip(key) False,
                       or None; the tier then evicts it and calls remove(key)

Policies:
    lru      least recently used.
    lfu      least frequently used, counting every access since start (not only
             while resident: "perfect" LFU), ties broken by recency.
    learned  usage history (exponentially decayed counts, persisted across
             restarts, see history.py) picks a hot set that fits in `fraction` of
             the budget; hot experts are protected, the rest is LRU, and a hot
             expert is evicted only when nothing else can be. The hot set always
             leaves room for the largest batch union seen (consecutive accesses of
             one layer), so the LRU part can take a layer's misses without evicting
             hot experts. `moetier bench cache` measured fraction 0.9 and a half-life
             of ~20k accesses best of the values tried on the synthetic traces.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from moetier.store.index import ExpertKey

Skip = Callable[[ExpertKey], bool]
POLICIES = ("lru", "lfu", "learned")


class Policy(ABC):
    name: str = ""

    @abstractmethod
    def record(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def insert(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def remove(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def victim(self, skip: Skip) -> ExpertKey | None: ...

    def protected(self) -> int:
        """Resident keys the policy holds on to (learned: its hot set); for stats."""
        return 0


def _first_unskipped(order: OrderedDict[ExpertKey, None], skip: Skip) -> ExpertKey | None:
    for k in order:  # least recent first; pinned keys are few and recent, so this stops early
        if not skip(k):
            return k
    return None


class LRU(Policy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def record(self, key: ExpertKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Skip) -> ExpertKey | None:
        return _first_unskipped(self._order, skip)


class LFU(Policy):
    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[ExpertKey, int] = {}
        self._last: dict[ExpertKey, int] = {}
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[int, int, ExpertKey]] = []  # (count, last access, key); stale entries skipped
        self._tick = itertools.count()

    def _push(self, key: ExpertKey) -> None:
        heapq.heappush(self._heap, (self._count.get(key, 0), self._last.get(key, 0), key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._heap = [(self._count.get(k, 0), self._last.get(k, 0), k) for k in self._resident]
            heapq.heapify(self._heap)

    def record(self, key: ExpertKey) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = next(self._tick)
        if key in self._resident:
            self._push(key)

    def insert(self, key: ExpertKey) -> None:
        self._resident.add(key)
        self._last.setdefault(key, next(self._tick))
        self._push(key)

    def remove(self, key: ExpertKey) -> None:
        self._resident.discard(key)

    def victim(self, skip: Skip) -> ExpertKey | None:
        skipped = []
        found = None
        while self._heap:
            c, t, k = self._heap[0]
            if k not in self._resident or c != self._count.get(k, 0) or t != self._last.get(k, 0):
                heapq.heappop(self._heap)  # stale
                continue
            if skip(k):
                skipped.append(heapq.heappop(self._heap))
                continue
            found = k
            break
        for e in skipped:
            heapq.heappush(self._heap, e)
        return found


class Learned(Policy):
    """Hot set from decayed usage counts (protected), LRU for the rest."""

    name = "learned"

    def __init__(self, layers: Sequence[int], n_experts: int, capacity: int, *, fraction: float = 0.9,
                 half_life: float = 20_000.0, refresh_every: int = 256,
                 counts: npt.NDArray[np.float64] | None = None) -> None:
        """capacity: experts the budget holds; the hot set takes up to `fraction` of it.
        half_life: demand accesses after which a use counts half. counts: [L, E] history."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"learned policy fraction must be in [0, 1], got {fraction}")
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.layers = tuple(layers)
        self.n_experts = n_experts
        self.capacity = max(0, int(capacity))
        self.fraction = fraction
        self.refresh_every = refresh_every
        self._growth = 2.0 ** (1.0 / half_life)
        self._inc = 1.0  # increment of the next access; grows instead of decaying every count
        shape = (len(self.layers), n_experts)
        self.counts = np.zeros(shape, dtype=np.float64)  # decayed uses, in units of _inc
        if counts is not None and counts.shape == shape:
            self.counts[:] = counts
        self._hot_mask = np.zeros(shape, dtype=bool)
        self._hot: OrderedDict[ExpertKey, None] = OrderedDict()  # resident and protected, LRU order
        self._cold: OrderedDict[ExpertKey, None] = OrderedDict()  # resident, not protected, LRU order
        self._since = 0
        self._run_layer = -1  # layer of the current run of accesses (one batch union)
        self._run = 0
        self._max_run = 0
        self._refresh()

    @property
    def protect(self) -> int:
        """Size of the hot set: `fraction` of capacity, leaving room for the largest union."""
        return max(0, min(int(self.fraction * self.capacity), self.capacity - self._max_run))

    def history(self) -> npt.NDArray[np.float64]:
        """Counts in units of one current access (what history.py persists)."""
        return self.counts / self._inc

    def _refresh(self) -> None:
        flat = self.counts.reshape(-1)
        mask = np.zeros(flat.shape, dtype=bool)
        n = min(self.protect, int(np.count_nonzero(flat)))
        if n:
            top = np.argpartition(-flat, n - 1)[:n] if n < flat.size else np.arange(flat.size)
            mask[top] = True
        self._hot_mask = mask.reshape(self.counts.shape)
        # move resident keys whose status changed, keeping LRU order within each list
        for k in [k for k in self._hot if not self._is_hot(k)]:
            del self._hot[k]
            self._cold[k] = None
        for k in [k for k in self._cold if self._is_hot(k)]:
            del self._cold[k]
            self._hot[k] = None

    def _is_hot(self, key: ExpertKey) -> bool:
        r = self.row.get(key[0])
        return r is not None and bool(self._hot_mask[r, key[1]])

    def record(self, key: ExpertKey) -> None:
        if key[0] != self._run_layer:
            self._run_layer, self._run = key[0], 0
        self._run += 1
        if self._run > self._max_run:
            self._max_run = self._run
        r = self.row.get(key[0])
        if r is not None:
            self.counts[r, key[1]] += self._inc
            self._inc *= self._growth
            if self._inc > 1e200:
                self.counts /= self._inc
                self._inc = 1.0
        for lst in (self._hot, self._cold):
            if key in lst:
                lst.move_to_end(key)
        self._since += 1
        if self._since >= self.refresh_every:
            self._since = 0
            self._refresh()

    def insert(self, key: ExpertKey) -> None:
        self._hot.pop(key, None)
        self._cold.pop(key, None)
        (self._hot if self._is_hot(key) else self._cold)[key] = None

    def remove(self, key: ExpertKey) -> None:
        self._hot.pop(key, None)
        self._cold.pop(key, None)

    def victim(self, skip: Skip) -> ExpertKey | None:
        k = _first_unskipped(self._cold, skip)
        return k if k is not None else _first_unskipped(self._hot, skip)

    def protected(self) -> int:
        return len(self._hot)


def make_policy(name: str, layers: Sequence[int], n_experts: int, capacity: int, *, fraction: float = 0.9,
                history: npt.NDArray[np.float64] | None = None, half_life: float = 20_000.0) -> Policy:
    """capacity: experts the budget holds (budget // record bytes)."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "learned":
        return Learned(layers, n_experts, capacity, fraction=fraction, counts=history, half_life=half_life)
    raise ValueError(f"unknown cache policy {name!r}; expected one of {POLICIES}")
