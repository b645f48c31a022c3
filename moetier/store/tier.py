"""The RAM tier: a byte budget of verified expert records over the I/O engine.

    with tier.acquire(layer, ids) as experts:    # {expert id: ExpertWeights}
        y = ops.moe(x, ids_tk, weights, experts)

`acquire` takes one layer's batch union: hits are pinned at once, misses are all
reserved and queued in one go (so their reads overlap), and the call returns when
every record has been read and verified. While pinned an expert is never evicted.

Invariants (kept under one lock):
  * resident bytes + bytes reserved for reads in flight <= budget, always;
    room is made by evicting unpinned resident experts in policy order;
  * if the pinned working set cannot fit, `acquire` waits up to `pin_wait_s` for
    other computes to release theirs, then raises ResourceExhausted naming the
    numbers; a batch union larger than the whole budget raises at once (callers
    cut such a union into `waves(layer, ids)` and pin one wave at a time);
  * a failed read (DataCorruption, Unavailable) fails only the acquires that need
    that expert; nothing of it stays behind, so the next acquire reads it again.

Prefetch: `prefetch(layer, ids)` is a hint. Its reads queue behind demand reads,
at most `prefetch_limit` at a time (over the bound the hint is dropped), and a
queued prefetch read is dropped when a newer hint for the same layer no longer
names it or when it is older than `prefetch_max_age` steps (`new_step()`).
A prefetched expert later demanded counts as useful; evicted unused, as wasted.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError, ResourceExhausted, Unavailable
from moetier.model.ops import unique_ids
from moetier.settings import Settings, resolve_budget
from moetier.store.buffers import Buffer, Holder
from moetier.store.history import load_history, save_history
from moetier.store.io import DEMAND, PREFETCH, IOEngine
from moetier.store.policy import Learned, Policy, make_policy
from moetier.store.stats import HEAT_LOADING, HEAT_PINNED, HEAT_RAM, HeatSnapshot, TierStats
from moetier.weights.index import ExpertIndex, ExpertKey

log = logging.getLogger(__name__)

IdsLike = Iterable[int] | npt.NDArray[np.integer[Any]]
SETTLE_STEPS = 16  # steps without a miss before a tier that holds everything stops wanting hints


@dataclass
class TierConfig:
    budget_bytes: int
    policy: str = "lru"  # lru | lfu | learned
    learned_fraction: float | None = None  # learned: hot-set share of the budget (None: adaptive)
    learned_half_life: float = 20_000.0  # demand accesses after which a use counts half
    history_path: Path | None = None  # learned: usage history file (loaded at start, saved on close)
    prefetch_limit: int = 16  # prefetch reads queued or running at most
    prefetch_max_age: int = 2  # steps after which a queued prefetch read is dropped
    pin_wait_s: float = 1.0  # how long an acquire waits for room held by other computes


def tier_config(settings: Settings, expert_bytes: int, store_id: str | None = None) -> TierConfig:
    """The tier's settings: budget (bytes or % of the expert bytes), policy, prefetch bound, and
    for the learned policy its usage history file (cache.history_path, else
    data_dir/history/<store_id>.hist; none without a store id)."""
    cache = settings.cache
    history = None
    if cache.policy == "learned":
        history = cache.history_path or (settings.data_path / "history" / f"{store_id}.hist" if store_id else None)
    return TierConfig(budget_bytes=resolve_budget(settings.model.expert_cache, expert_bytes),
                      policy=cache.policy, learned_fraction=cache.pin_fraction, history_path=history,
                      prefetch_limit=settings.storage.prefetch_depth)


@dataclass(eq=False)
class _Entry:
    key: ExpertKey
    nbytes: int
    ready: Future[Any] | None = field(default_factory=Future)  # resolves with the value once verified
    loading: bool = True
    buf: Buffer | None = None
    value: Any = None
    pins: int = 0
    prefetched: bool = False  # brought in by a hint
    used: bool = False  # demanded since it came in
    hint_step: int = 0


@dataclass
class _Arena:
    fd: int
    mapping: mmap.mmap
    size: int
    offsets: dict[ExpertKey, int]  # each record's page-aligned slot, in key order
    bytes: Buffer  # the whole mapping


@dataclass
class SharedRecords:
    """Every record of a tier in one shared memory (`ExpertTier.share`)."""

    fd: int  # the memfd (the tier's: closed with it)
    mapping: mmap.mmap
    size: int  # bytes
    table: npt.NDArray[np.int64]  # [N, 4] (layer, expert, offset, length), in key order


@dataclass
class HintOutcome:
    """What became of one prefetch hint's experts."""

    queued: int = 0  # reads started
    present: int = 0  # already resident or being read
    dropped: int = 0  # over the prefetch bound, or no room in the budget


class Lease:
    """Experts pinned for one compute; `experts` maps expert id -> value (filled by `pin`).
    Release exactly once."""

    def __init__(self, tier: ExpertTier, layer: int, entries: list[_Entry], misses: int) -> None:
        self.tier = tier
        self.layer = layer
        self.entries = entries
        self.misses = misses
        self.experts: dict[int, Any] = {}
        self.wait_s = 0.0  # time `arrivals` blocked waiting for reads
        self._released = False

    def arrivals(self) -> Iterator[dict[int, Any]]:
        """The leased experts as they become usable, {expert id: value} at a time: first every
        one already resident, then the reads as they complete (those that finished together in
        one). A caller computes each while the rest are read. Once every read has ended, the
        first that failed is raised (a failed read is never yielded)."""
        pending: dict[Future[Any], int] = {}
        now: dict[int, Any] = {}
        first: BaseException | None = None
        for e in self.entries:
            ready = e.ready
            assert ready is not None  # a pinned entry keeps its future
            if ready.done():
                first = _take(ready, e.key[1], now, first)
            else:
                pending[ready] = e.key[1]
        if now:
            yield now
        while pending:
            t0 = time.perf_counter()
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            self.wait_s += time.perf_counter() - t0
            now = {}
            for f in done:
                first = _take(f, pending.pop(f), now, first)
            if now and first is None:
                yield now
        if self.misses:
            self.tier._observe_miss_wait(self.wait_s)
        if first is not None:
            raise first

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.tier._end(self)


def _take(f: Future[Any], expert: int, into: dict[int, Any], first: BaseException | None) -> BaseException | None:
    exc = f.exception()
    if exc is not None:
        return first or exc
    into[expert] = f.result()
    return first


class ExpertTier:
    def __init__(self, engine: IOEngine, config: TierConfig) -> None:
        self.engine = engine
        self.index: ExpertIndex = engine.index
        self.config = config
        self.budget = int(config.budget_bytes)
        self.capacity = self.budget // self.index.record_bytes
        if self.capacity < 1:
            raise ResourceExhausted(f"RAM tier budget of {self.budget} bytes holds no expert record "
                                    f"({self.index.record_bytes} bytes each)")
        history = None
        if config.policy == "learned" and config.history_path is not None:
            history = load_history(config.history_path, self.index.layers, self.index.n_experts,
                                   self.index.identity)
        self.policy: Policy = make_policy(config.policy, self.index.layers, self.index.n_experts, self.capacity,
                                          fraction=config.learned_fraction, history=history,
                                          half_life=config.learned_half_life)
        self._cond = threading.Condition(threading.RLock())
        self._entries: dict[ExpertKey, _Entry] = {}
        self._prefetching: dict[ExpertKey, _Entry] = {}  # prefetch reads not completed
        self._ready_bytes = 0
        self._loading_bytes = 0
        self._pinned_ready_bytes = 0
        self._step = 0
        self._roomy = self.budget >= self.index.total_bytes  # never evicts
        self._missed_step = 0  # the step of the latest miss or failed read (see settled)
        self._row = self.index.layer_row()
        self._uses = np.zeros((len(self.index.layers), self.index.n_experts), dtype=np.uint32)
        self._stats = TierStats(policy=config.policy, budget_bytes=self.budget,
                                hits={layer: 0 for layer in self.index.layers},
                                misses={layer: 0 for layer in self.index.layers},
                                prefetch_useful_by_layer={layer: 0 for layer in self.index.layers},
                                prefetch_wasted_by_layer={layer: 0 for layer in self.index.layers})
        self._closed = False
        self._arena: _Arena | None = None  # use_shared_memory
        self._shared: SharedRecords | None = None

    @classmethod
    def open(cls, index: ExpertIndex, config: TierConfig, **engine_options: Any) -> ExpertTier:
        """A tier over its own I/O engine (options: mirrors, depth, direct, mirror_weights, probe...)."""
        return cls(IOEngine(index, **engine_options), config)

    # ---- demand ---------------------------------------------------------------------
    @contextmanager
    def acquire(self, layer: int, ids: IdsLike) -> Iterator[dict[int, Any]]:
        """Pin the experts `ids` of `layer` (loading the misses together) for the block."""
        lease = self.pin(layer, ids)
        try:
            yield lease.experts
        finally:
            lease.release()

    def pin(self, layer: int, ids: IdsLike) -> Lease:
        """Pin and load; the caller must `release()` the lease (prefer `acquire`)."""
        lease = self.begin(layer, ids)
        assert lease is not None
        try:
            for experts in lease.arrivals():
                lease.experts.update(experts)
        except BaseException:
            lease.release()
            raise
        return lease

    def begin(self, layer: int, ids: IdsLike, *, block: bool = True) -> Lease | None:
        """Pin the experts `ids` of `layer` without waiting for their reads: the resident ones
        pinned, the missing ones reserved and queued together (demand priority); `Lease.arrivals`
        hands them out as they become usable. When the budget has no room (other computes hold
        it) this waits up to `pin_wait_s` for them to release, or with `block=False` returns None
        at once instead. The caller must `release()` the lease."""
        return self._begin(layer, ids, block)

    def waves(self, layer: int, ids: IdsLike) -> list[list[int]]:
        """The batch union of `layer` cut into waves of expert ids that each fit in the budget,
        for a caller that pins one wave at a time (pin, compute, release, next wave): the way a
        union larger than the budget is computed. One wave when the union fits. Experts already
        resident or being read come first, so the first wave's reads never evict an expert a
        later wave of the same call needs; then the rest in id order. An expert larger than the
        whole budget (the tier's constructor refuses such a budget) gets a wave of its own, and
        pinning it raises ResourceExhausted."""
        union = unique_ids(ids)
        if len(union) * self.index.record_bytes <= self.budget:  # record_bytes: the largest record
            return [union]  # fits (checked when pinned); the common case stays cheap
        keys = self._keys(layer, union)
        with self._cond:
            present = [k for k in keys if k in self._entries]
        have = set(present)
        waves: list[list[int]] = []
        nbytes = self.budget + 1  # bytes of the wave being filled; none yet
        for k in present + [k for k in keys if k not in have]:
            n = self.index.records[k].length
            if nbytes + n > self.budget:
                waves.append([])
                nbytes = 0
            waves[-1].append(k[1])
            nbytes += n
        return waves

    def _keys(self, layer: int, ids: IdsLike) -> list[ExpertKey]:
        layer = int(layer)
        keys = [(layer, i) for i in unique_ids(ids)]
        for k in keys:
            self.index.location(k)  # NotFound for an unknown layer or expert
        return keys

    def _begin(self, layer: int, ids: IdsLike, block: bool) -> Lease | None:
        keys = self._keys(layer, ids)
        nbytes = {k: self.index.records[k].length for k in keys}
        total = sum(nbytes.values())
        if total > self.budget:
            raise ResourceExhausted(f"layer {layer}: the batch needs {len(keys)} experts ({total} bytes) at once, "
                                    f"more than the RAM tier budget of {self.budget} bytes")
        deadline = time.monotonic() + self.config.pin_wait_s
        with self._cond:
            while True:
                self._check_open()
                mine = sum(n for k, n in nbytes.items()
                           if (e := self._entries.get(k)) is not None and not e.loading and e.pins == 0)
                need = sum(n for k, n in nbytes.items() if k not in self._entries)
                committed = self._pinned_ready_bytes + self._loading_bytes + mine + need
                if committed <= self.budget:
                    break
                if self._drop_queued_prefetches():
                    continue
                left = deadline - time.monotonic()
                if not block and left > 0:
                    return None
                if left <= 0:
                    raise ResourceExhausted(
                        f"RAM tier budget of {self.budget} bytes exhausted: {self._pinned_ready_bytes} bytes pinned "
                        f"by running computes and {self._loading_bytes} bytes being read, while layer {layer} needs "
                        f"{mine + need} more bytes for {len(keys)} experts", retry_after_s=0.1)
                self._cond.wait(left)
            return self._commit(layer, keys, nbytes)

    def _commit(self, layer: int, keys: list[ExpertKey], nbytes: dict[ExpertKey, int]) -> Lease:
        entries: list[_Entry] = []
        new: list[_Entry] = []
        row = self._row[layer]
        hits = 0
        for k in keys:
            self.policy.record(k)
            self._uses[row, k[1]] += 1
            e = self._entries.get(k)
            if e is None:
                e = _Entry(k, nbytes[k])
                self._entries[k] = e
                self._loading_bytes += e.nbytes
                new.append(e)
            else:
                if e.prefetched and not e.used:
                    self._stats.prefetch_useful += 1
                    self._stats.prefetch_useful_by_layer[layer] += 1
                if e.loading:
                    self.engine.promote(k)  # a queued prefetch read moves ahead of other prefetches
                else:
                    hits += 1
                    if e.pins == 0:
                        self._pinned_ready_bytes += e.nbytes
            e.used = True
            e.pins += 1
            entries.append(e)
        self._stats.hits[layer] += hits
        self._stats.misses[layer] += len(keys) - hits
        if hits < len(keys):
            self._missed_step = self._step
        self._make_room()
        for e in new:  # into the policy now, in key order, so decisions never depend on read timing
            self.policy.insert(e.key)
            self._start_read(e, DEMAND)
        return Lease(self, layer, entries, len(keys) - hits)

    def _observe_miss_wait(self, seconds: float) -> None:
        with self._cond:
            self._stats.miss_wait.observe(seconds)

    def _end(self, lease: Lease) -> None:
        with self._cond:
            for e in lease.entries:
                e.pins -= 1
                if e.pins == 0 and not e.loading and self._entries.get(e.key) is e:
                    self._pinned_ready_bytes -= e.nbytes
            self._cond.notify_all()

    # ---- reads and eviction (under the lock) ----------------------------------------
    def _start_read(self, e: _Entry, priority: int) -> None:
        into = None
        if self._arena is not None:  # the record's own slot of the shared memory
            off = self._arena.offsets[e.key]
            into = self._arena.bytes[off : off + -(-e.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE]
        fut = self.engine.submit(e.key, priority, into)
        fut.add_done_callback(lambda f, e=e: self._loaded(e, f))  # type: ignore[misc]

    def _loaded(self, e: _Entry, fut: Future[Buffer]) -> None:
        """Runs on the I/O worker (or the canceller) when a read ends."""
        value: Any = None
        exc: BaseException | None = None
        buf: Buffer | None = None
        rec: Buffer | None = None
        if fut.cancelled():
            exc = ResourceExhausted("prefetch read dropped")
        elif (exc := fut.exception()) is None:
            buf = fut.result()
            try:
                rec = buf[: e.nbytes]
                value = self.index.parse(rec) if self.index.parse is not None else rec
            except Exception as pe:
                exc = FormatError(f"layer {e.key[0]} expert {e.key[1]}: record does not parse ({pe})")
        with self._cond:
            current = self._entries.get(e.key) is e
            if current:
                self._loading_bytes -= e.nbytes
                e.loading = False
                self._prefetching.pop(e.key, None)
                if exc is None:
                    e.buf, e.value = buf, value
                    self._ready_bytes += e.nbytes
                    if e.pins:
                        self._pinned_ready_bytes += e.nbytes
                else:
                    del self._entries[e.key]
                    self._missed_step = self._step
                    self.policy.remove(e.key)
                    if fut.cancelled():
                        self._stats.prefetch_dropped += 1
                    else:
                        self._stats.failed_loads += 1
                self._cond.notify_all()
        ready = e.ready
        assert ready is not None
        if exc is None and current:
            ready.set_result(value)
            return
        ready.set_exception(exc or Unavailable("read superseded"))
        if buf is not None and self._arena is None:  # a parse failure: nobody got the record (a slot stays)
            box = Holder(buf)
            del buf, value, rec
            self.engine.reclaim(box)

    def _skip(self, key: ExpertKey) -> bool:
        e = self._entries[key]
        return e.pins > 0 or e.loading

    def _make_room(self) -> None:
        while self._ready_bytes + self._loading_bytes > self.budget:
            victim = self.policy.victim(self._skip)
            if victim is None:  # the admission check makes this unreachable
                raise ResourceExhausted(f"RAM tier: nothing left to evict within {self.budget} bytes")
            self._evict(victim)

    def _evict(self, key: ExpertKey) -> None:
        e = self._entries.pop(key)
        assert not e.loading and e.pins == 0
        self.policy.remove(key)
        self._ready_bytes -= e.nbytes
        self._stats.evictions += 1
        if e.prefetched and not e.used:
            self._stats.prefetch_wasted += 1
            self._stats.prefetch_wasted_by_layer[key[0]] += 1
        e.value = e.ready = None  # drop every reference of ours so the buffer can be recycled
        if self._arena is None:  # (a tier in shared memory never evicts; its slots are never pooled)
            # evictions make room for reads: the records being loaded that hold no buffer yet
            # (queued, or about to be) will take this one. Kept for them, the pool's idle
            # buffers stay within the budget (ready + those reads' bytes); dropped, each would
            # be unmapped here and a fresh one mapped and faulted in by the read.
            wanted = self._loading_bytes // self.index.record_bytes - self.engine.reading
            self.engine.reclaim(e, wanted=wanted)

    # ---- preload --------------------------------------------------------------------
    def preload(self) -> tuple[int, int, int]:
        """Read every expert not yet here, when the budget holds them all (a roomy tier, which
        never evicts), and wait for the reads; else nothing. Reads go at prefetch priority, so a
        demand read goes first; they count neither as hits, misses nor prefetches. A read that
        fails leaves its expert to be read on demand (which then fails, or not, as it will).
        Returns (experts read, bytes read, reads failed)."""
        if not self._roomy:
            return 0, 0, 0
        mine: list[_Entry] = []
        with self._cond:
            self._check_open()
            for k in sorted(self.index.records):
                if k in self._entries:
                    continue
                e = _Entry(k, self.index.records[k].length)
                self._entries[k] = e
                self._loading_bytes += e.nbytes
                self.policy.insert(k)
                mine.append(e)
            for e in mine:
                self._start_read(e, PREFETCH)
        done = [(e.nbytes, e.ready) for e in mine if e.ready is not None]
        wait([f for _, f in done])
        ok = [n for n, f in done if f.exception() is None]
        return len(ok), sum(ok), len(mine) - len(ok)

    # ---- shared memory ----------------------------------------------------------------
    def use_shared_memory(self) -> bool:
        """Keep every record in one shared memory (a memfd, records page-aligned in key order)
        that `share` can then hand to another process on this host: reads from now on land there.
        Only a tier whose budget holds every expert (it never evicts, so no record moves and none
        is overwritten); call before any read (the store: before its preload). Returns whether
        the tier does so."""
        with self._cond:
            self._check_open()
            if not self._roomy:
                return False
            if self._arena is None:
                keys = sorted(self.index.records)
                offsets, size = {}, 0
                for k in keys:
                    offsets[k] = size
                    size += -(-self.index.records[k].length // mmap.PAGESIZE) * mmap.PAGESIZE
                fd = os.memfd_create("moetier-experts", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, max(size, mmap.PAGESIZE))
                    mm = mmap.mmap(fd, max(size, mmap.PAGESIZE))
                except BaseException:
                    os.close(fd)
                    raise
                self._arena = _Arena(fd, mm, size, offsets, np.frombuffer(mm, dtype=np.uint8))
            return True

    def share(self) -> SharedRecords | None:
        """The shared memory of `use_shared_memory` for another process to map and compute from
        (the local lane: moetier/rpc/local.py), once every record is resident in it (after
        `preload`); None before, or without it. Shared once: later calls return the same."""
        with self._cond:
            self._check_open()
            arena = self._arena
            if self._shared is not None or arena is None:
                return self._shared
            rows = []
            for k, off in arena.offsets.items():
                e = self._entries.get(k)
                if e is None or e.loading or e.buf is None:
                    return None
                rows.append((k[0], k[1], off, e.nbytes))
            self._shared = SharedRecords(arena.fd, arena.mapping, arena.size, np.array(rows, dtype=np.int64))
            return self._shared

    @property
    def shared(self) -> SharedRecords | None:
        """The shared memory of `share`, once shared."""
        return self._shared

    def resident_values(self, layer: int, n: int) -> list[Any] | None:
        """The parsed records of experts 0..n-1 of `layer` where the tier never evicts and every one
        is resident (each then stays so until the tier closes); None otherwise. Not a use: count
        the calls computed from them with `note_shared`."""
        with self._cond:
            if self._closed or not self._roomy:
                return None
            out = []
            for i in range(n):
                e = self._entries.get((int(layer), i))
                if e is None or e.loading or e.value is None:
                    return None
                out.append(e.value)
            return out

    def note_shared(self, layer: int, experts: npt.NDArray[np.int64], calls: npt.NDArray[np.int64]) -> None:
        """Count calls of `layer` that another process computed from the shared records as this
        tier's own: `calls[i]` calls held expert `experts[i]` in their union (hits, usage, the
        policy's record). Unknown experts are a NotFound."""
        keys = self._keys(layer, experts)
        with self._cond:
            row = self._row[layer]
            for k, n in zip(keys, np.asarray(calls, dtype=np.int64).tolist(), strict=True):
                for _ in range(n):
                    self.policy.record(k)
                self._uses[row, k[1]] += n
                self._stats.hits[layer] += n

    # ---- prefetch -------------------------------------------------------------------
    def prefetch(self, layer: int, ids: IdsLike) -> int:
        """Hint that `layer` will soon need `ids`; returns the reads queued."""
        return self.hint(layer, ids).queued

    def hint(self, layer: int, ids: IdsLike) -> HintOutcome:
        """`prefetch`, telling what became of each hinted expert."""
        keys = self._keys(layer, ids)
        wanted = set(keys)
        out = HintOutcome()
        with self._cond:
            self._check_open()
            for k in list(self._prefetching):
                if k[0] == layer and k not in wanted:
                    self.engine.cancel(k)  # superseded; runs _loaded when it was still queued
            self._stats.prefetch_hints += len(keys)
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    if e.loading and e.prefetched:
                        e.hint_step = self._step
                    out.present += 1
                    continue
                n = self.index.records[k].length
                if (len(self._prefetching) >= self.config.prefetch_limit
                        or self._pinned_ready_bytes + self._loading_bytes + n > self.budget):
                    self._stats.prefetch_dropped += 1
                    out.dropped += 1
                    continue
                e = _Entry(k, n, prefetched=True, hint_step=self._step)
                self._entries[k] = e
                self._prefetching[k] = e
                self._loading_bytes += n
                self._make_room()
                self.policy.insert(k)
                self._stats.prefetch_issued += 1
                out.queued += 1
                self._start_read(e, PREFETCH)
        return out

    def new_step(self) -> None:
        """A decode step began: queued prefetch reads older than prefetch_max_age are dropped."""
        with self._cond:
            self._step += 1
            for k, e in list(self._prefetching.items()):
                if e.hint_step < self._step - self.config.prefetch_max_age:
                    self.engine.cancel(k)

    def _drop_queued_prefetches(self) -> bool:
        return sum(self.engine.cancel(k) for k in list(self._prefetching)) > 0

    # ---- observation ----------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._cond:
            s = self._stats
            out = TierStats(
                policy=s.policy, budget_bytes=s.budget_bytes, resident_bytes=self._ready_bytes,
                resident_experts=sum(1 for e in self._entries.values() if not e.loading),
                loading_bytes=self._loading_bytes,
                loading_experts=sum(1 for e in self._entries.values() if e.loading),
                pinned_experts=sum(1 for e in self._entries.values() if e.pins),
                protected_experts=self.policy.protected(),
                hits=dict(s.hits), misses=dict(s.misses), evictions=s.evictions, failed_loads=s.failed_loads,
                prefetch_hints=s.prefetch_hints, prefetch_issued=s.prefetch_issued,
                prefetch_useful=s.prefetch_useful, prefetch_wasted=s.prefetch_wasted,
                prefetch_useful_by_layer=dict(s.prefetch_useful_by_layer),
                prefetch_wasted_by_layer=dict(s.prefetch_wasted_by_layer),
                prefetch_dropped=s.prefetch_dropped, miss_wait=s.miss_wait.copy(),
            )
        out.io = self.engine.stats()
        return out

    def heat(self) -> HeatSnapshot:
        with self._cond:
            uses = self._uses.copy()
            state = np.zeros(uses.shape, dtype=np.uint8)
            for (layer, ex), e in self._entries.items():
                state[self._row[layer], ex] = HEAT_PINNED if e.pins else HEAT_LOADING if e.loading else HEAT_RAM
        return HeatSnapshot(np.asarray(self.index.layers, dtype=np.int32), uses, state)

    def settled(self) -> bool:
        """The budget holds every expert of the index (nothing is ever evicted) and the last
        SETTLE_STEPS steps found every expert they used resident: prefetch hints can at most
        save the read of an expert never used so far, which costs less than predicting them
        every step. A miss (or a failed read) unsettles the tier. Read without the lock, for
        callers deciding whether to predict at all."""
        return self._roomy and self._step - self._missed_step >= SETTLE_STEPS

    def resident(self) -> set[ExpertKey]:
        with self._cond:
            return {k for k, e in self._entries.items() if not e.loading}

    def check_invariants(self) -> None:
        """Recount the bookkeeping from the entries (tests)."""
        with self._cond:
            ready = sum(e.nbytes for e in self._entries.values() if not e.loading)
            loading = sum(e.nbytes for e in self._entries.values() if e.loading)
            pinned = sum(e.nbytes for e in self._entries.values() if not e.loading and e.pins)
            assert (ready, loading, pinned) == (self._ready_bytes, self._loading_bytes, self._pinned_ready_bytes)
            assert ready + loading <= self.budget, f"{ready} + {loading} bytes exceed the budget {self.budget}"

    # ---- persistence and shutdown ---------------------------------------------------
    def save_history(self) -> bool:
        """Write the learned policy's usage history (atomically); False when there is none to write."""
        if not isinstance(self.policy, Learned) or self.config.history_path is None:
            return False
        with self._cond:
            counts = self.policy.history().copy()
        save_history(self.config.history_path, counts, self.index.layers, self.index.identity)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the expert tier is closed")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # acquires waiting for room fail now, not at their deadline
        try:
            self.save_history()
        except OSError as e:
            log.warning("could not save usage history to %s: %s", self.config.history_path, e)
        self.engine.close()
        if self._arena is not None:
            os.close(self._arena.fd)  # the mapping goes with the last view of it

    def __enter__(self) -> ExpertTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
