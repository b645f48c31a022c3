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
             restarts, see history.py) picks a hot set that fits in a fraction of
             the budget; hot experts are protected, the rest is LRU, and a hot
             expert is evicted only when nothing else can be. The hot set always
             leaves room for the largest batch union seen (consecutive accesses of
             one layer), so the LRU part can take a layer's misses without evicting
             hot experts. The fraction is fixed, or (default) chosen among 0, 0.5
             and 0.9 by sampled shadow caches (see Learned).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument
from moetier.weights.index import ExpertKey

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


FRACTIONS = (0.0, 0.5, 0.9)  # hot-set sizes the adaptive learned policy chooses among
SHADOW_KEYS = 1024  # experts the shadow caches sample (spatial sampling, as in SHARDS)


class _Shadow:
    """A key-sampled miniature of the learned policy at one hot-set fraction: it replays the
    sampled keys' accesses in a cache scaled by the sampling rate and counts its hits."""

    def __init__(self, fraction: float, capacity: int) -> None:
        self.fraction = fraction
        self.capacity = max(1, capacity)
        self.hot: OrderedDict[ExpertKey, None] = OrderedDict()
        self.cold: OrderedDict[ExpertKey, None] = OrderedDict()
        self.hits = 0.0
        self.group: set[ExpertKey] = set()  # the current batch union (never evicts its own members)
        self.group_layer = -1
        self.max_group = 0

    @property
    def protect(self) -> int:
        return max(0, min(int(self.fraction * self.capacity), self.capacity - self.max_group))

    def access(self, key: ExpertKey, hot: bool) -> None:
        if key[0] != self.group_layer:
            self.group.clear()
            self.group_layer = key[0]
        self.group.add(key)
        self.max_group = max(self.max_group, len(self.group))
        for lst in (self.hot, self.cold):
            if key in lst:
                lst.move_to_end(key)
                self.hits += 1
                return
        while len(self.hot) + len(self.cold) >= self.capacity:
            v = _first_unskipped(self.cold, self.group.__contains__)
            if v is None:
                v = _first_unskipped(self.hot, self.group.__contains__)
            if v is None:
                return
            self.hot.pop(v, None)
            self.cold.pop(v, None)
        (self.hot if hot else self.cold)[key] = None

    def regroup(self, is_hot: Callable[[ExpertKey], bool]) -> None:
        _regroup(self.hot, self.cold, is_hot)


class Learned(Policy):
    """Hot set from decayed usage counts (protected), LRU for the rest.

    The best hot-set size depends on the traffic: a large one wins when popularity is
    skewed and the cache is small (an LRU part smaller than one step's working set only
    thrashes), a small one when consecutive steps reuse experts and the LRU part can hold
    a step. With `fraction=None` the policy picks among FRACTIONS (0.0 is plain LRU)
    from shadow caches that replay a key sample of the accesses at each fraction, so it
    follows the best of them, LRU included, as the traffic changes.
    """

    name = "learned"

    def __init__(self, layers: Sequence[int], n_experts: int, capacity: int, *, fraction: float | None = None,
                 half_life: float = 20_000.0, refresh_every: int = 256, choose_every: int = 2048,
                 counts: npt.NDArray[np.float64] | None = None) -> None:
        """capacity: experts the budget holds; the hot set takes up to `fraction` of it (None:
        adaptive). half_life: demand accesses after which a use counts half. counts: [L, E] history."""
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise InvalidArgument(f"learned policy fraction must be in [0, 1], got {fraction}")
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.layers = tuple(layers)
        self.n_experts = n_experts
        self.capacity = max(0, int(capacity))
        self.fraction = FRACTIONS[1] if fraction is None else fraction
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
        # adaptive fraction: shadows over a deterministic sample of the keys
        total = max(1, len(self.layers) * n_experts)
        self._rate = min(1.0, SHADOW_KEYS / total)
        sampled = _sample_mask(shape, self._rate)
        self._sampled = sampled  # [L, E] bool
        self._sampled_flat = np.flatnonzero(sampled.reshape(-1))
        self._shadow_hot = [np.zeros(shape, dtype=bool) for _ in FRACTIONS]
        # Shadows that hold every sampled key never evict: each sees a miss on a key's first
        # access and a hit on every later one, all of them alike, so their hit counts tie and
        # `_choose` keeps the fraction. Replaying them (a few microseconds per access, the
        # expert store's largest cost per call outside the kernels where the budget holds the
        # whole model) would change nothing: they are left out.
        shadow_capacity = round(self._rate * self.capacity)
        fits = shadow_capacity >= len(self._sampled_flat)
        self._shadows = [] if fraction is not None or fits else [_Shadow(f, shadow_capacity) for f in FRACTIONS]
        self._choose_every = choose_every
        self._sampled_since = 0
        self._refresh()

    @property
    def protect(self) -> int:
        """Size of the hot set: `fraction` of capacity, leaving room for the largest union."""
        return max(0, min(int(self.fraction * self.capacity), self.capacity - self._max_run))

    def history(self) -> npt.NDArray[np.float64]:
        """Counts in units of one current access (what history.py persists)."""
        return self.counts / self._inc

    @staticmethod
    def _top(flat: npt.NDArray[np.float64], idx: npt.NDArray[np.intp], n: int, size: int) -> npt.NDArray[np.bool_]:
        """Mask of the n keys among `idx` with the highest counts (keys never used excluded)."""
        mask = np.zeros(size, dtype=bool)
        vals = flat[idx]
        n = min(n, int(np.count_nonzero(vals)))
        if n:
            top = idx[np.argpartition(-vals, n - 1)[:n]] if n < idx.size else idx
            mask[top] = True
        return mask

    def _refresh(self) -> None:
        # A list is regrouped only when its hot set changed: every key was placed by the mask
        # of its time (insert, regroup), so under an unchanged mask a regroup moves nothing.
        flat = self.counts.reshape(-1)
        m = self._top(flat, np.arange(flat.size), self.protect, flat.size).reshape(self.counts.shape)
        changed = not np.array_equal(m, self._hot_mask)
        self._hot_mask = m
        if changed:
            _regroup(self._hot, self._cold, self._is_hot)
        for i, sh in enumerate(self._shadows):
            m = self._top(flat, self._sampled_flat, sh.protect, flat.size).reshape(self.counts.shape)
            changed = not np.array_equal(m, self._shadow_hot[i])
            self._shadow_hot[i] = m
            if changed:
                sh.regroup(lambda k, m=m: bool(m[self.row[k[0]], k[1]]))  # type: ignore[misc]

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
            if self._shadows and self._sampled[r, key[1]]:
                for i, sh in enumerate(self._shadows):
                    sh.access(key, bool(self._shadow_hot[i][r, key[1]]))
                self._sampled_since += 1
                if self._sampled_since >= self._choose_every:
                    self._sampled_since = 0
                    self._choose()
        for lst in (self._hot, self._cold):
            if key in lst:
                lst.move_to_end(key)
        self._since += 1
        if self._since >= self.refresh_every:
            self._since = 0
            self._refresh()

    def _choose(self) -> None:
        """Follow the shadow with the most (recent) hits; keep the current one on a tie."""
        current = next(sh for sh in self._shadows if sh.fraction == self.fraction)
        best = max(self._shadows, key=lambda sh: sh.hits)
        if best.hits > current.hits * 1.01:
            self.fraction = best.fraction
        for sh in self._shadows:
            sh.hits *= 0.5

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


def _regroup(hot: OrderedDict[ExpertKey, None], cold: OrderedDict[ExpertKey, None],
             is_hot: Callable[[ExpertKey], bool]) -> None:
    """Move resident keys whose hot status changed, keeping LRU order within each list."""
    for k in [k for k in hot if not is_hot(k)]:
        del hot[k]
        cold[k] = None
    for k in [k for k in cold if is_hot(k)]:
        del cold[k]
        hot[k] = None


def _sample_mask(shape: tuple[int, int], rate: float) -> npt.NDArray[np.bool_]:
    """A deterministic pseudo-random subset of the (layer row, expert) keys at `rate`."""
    r, e = np.meshgrid(np.arange(shape[0], dtype=np.uint64), np.arange(shape[1], dtype=np.uint64), indexing="ij")
    h = ((r * np.uint64(0x9E3779B1) + e) * np.uint64(0x85EBCA77)) & np.uint64(0xFFFFFFFF)
    return h < np.uint64(int(rate * 2**32)) if rate < 1.0 else np.ones(shape, dtype=bool)


def make_policy(name: str, layers: Sequence[int], n_experts: int, capacity: int, *, fraction: float | None = None,
                history: npt.NDArray[np.float64] | None = None, half_life: float = 20_000.0) -> Policy:
    """capacity: experts the budget holds (budget // record bytes)."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "learned":
        return Learned(layers, n_experts, capacity, fraction=fraction, counts=history, half_life=half_life)
    raise InvalidArgument(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")
