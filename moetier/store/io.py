"""The I/O engine: one aligned, checksummed read per expert record.

Reads run on `depth` worker threads doing `os.preadv` (O_DIRECT where the
filesystem allows it) into page-aligned pooled buffers, so at most `depth` reads
are in flight and the asyncio event loop never blocks. Requests go through a
priority queue: demand reads before prefetch reads; a queued prefetch can be
cancelled (stale hint) or promoted (now demanded).

Single-flight: every request for a record already queued or being read joins
that read (`IOStats.joined`), so N concurrent misses of one expert cost one disk
read. A batch (`read`, `aread`, or several `submit`s in a row) is queued in one
go, before any of its reads is waited for.

Every record read from disk is checked against its xxh3_64 checksum before its
future resolves. On a mismatch or a read error the next copy is tried (see
copies.py for the order); with no valid copy the future raises DataCorruption
(naming layer, expert, file and offset) or Unavailable (I/O errors only). A
failure affects only that record's requests, and is not remembered: the next
request for it reads again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from moetier.errors import DataCorruption, InvalidArgument, Unavailable
from moetier.store.buffers import Buffer, BufferPool, Holder
from moetier.store.copies import Copy, CopyMissing, CopySet
from moetier.store.stats import IOStats
from moetier.testhooks import ReadDelay
from moetier.weights.index import ExpertIndex, ExpertKey, RecordLocation

log = logging.getLogger(__name__)

DEMAND = 0
PREFETCH = 1
_STOP = -1

QUEUED, RUNNING, DONE, CANCELLED = range(4)


@dataclass(eq=False)
class _Job:
    key: ExpertKey
    loc: RecordLocation
    priority: int
    future: Future[Buffer] = field(default_factory=Future)
    state: int = QUEUED
    into: Buffer | None = None  # the caller's buffer for the record (else one of the pool's)


class IOEngine:
    def __init__(
        self,
        index: ExpertIndex,
        *,
        mirrors: Sequence[Path | str] = (),
        depth: int = 8,
        direct: bool = True,
        mirror_weights: Sequence[float] | None = None,
        probe: bool = True,
        reprobe_interval_s: float = 10.0,
        free_buffers: int | None = None,
        read_delay: ReadDelay | None = None,
    ) -> None:
        """depth: worker threads = reads in flight at most. direct: O_DIRECT where possible
        (False: buffered). mirror_weights: placement weights, one per copy, primary first;
        without them, with mirrors, each copy's read bandwidth is probed at start-up (`probe`)
        or all weigh the same. free_buffers: pooled idle buffers kept (default depth + 2).
        read_delay: test only (a slow disk, for the chaos harness): slept before every record read."""
        if depth < 1:
            raise InvalidArgument(f"I/O queue depth must be >= 1, got {depth}")
        self.index = index
        self.depth = depth
        self.copies = CopySet(index, mirrors, direct=direct, weights=mirror_weights,
                              reprobe_interval_s=reprobe_interval_s)
        self.pool = BufferPool(index.record_bytes, depth + 2 if free_buffers is None else free_buffers)
        self._lock = threading.Lock()
        self._inflight: dict[ExpertKey, _Job] = {}
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._stats = IOStats(depth=depth, disks=[c.stats for c in self.copies.copies])
        self._closed = False
        self._read_delay = read_delay
        self._workers = [threading.Thread(target=self._work, name=f"moetier-io-{i}", daemon=True)
                         for i in range(depth)]
        for w in self._workers:
            w.start()
        if probe and mirror_weights is None and len(self.copies.copies) > 1:
            self.probe()

    @property
    def direct(self) -> bool:
        """Whether the primary's reads bypass the page cache."""
        return self.copies.primary.stats.direct

    # ---- submitting -----------------------------------------------------------------
    def submit(self, key: ExpertKey, priority: int = DEMAND, into: Buffer | None = None) -> Future[Buffer]:
        """The future of record `key` (a page-aligned buffer; the record is its first
        `index.location(key).length` bytes). Joins a read in flight; a demand request
        promotes a queued prefetch read. into: read into this page-aligned buffer of at least
        the record's length (the caller's, never the pool's) instead of a pooled one."""
        loc = self.index.location(key)
        with self._lock:
            if self._closed:
                raise Unavailable("the I/O engine is closed")
            job = self._inflight.get(key)
            if job is not None:
                self._stats.joined += 1
                if priority < job.priority and job.state == QUEUED:
                    job.priority = priority  # the stale queue entry is skipped when popped
                    self._queue.put((priority, next(self._seq), job))
                return job.future
            job = _Job(key, loc, priority, into=into)
            self._inflight[key] = job
            self._stats.submitted += 1
            self._stats.queued += 1
            self._queue.put((priority, next(self._seq), job))
            return job.future

    def cancel(self, key: ExpertKey) -> bool:
        """Drop a queued prefetch read of `key`; False if it is demanded, running or done."""
        with self._lock:
            job = self._inflight.get(key)
            if job is None or job.state != QUEUED or job.priority != PREFETCH:
                return False
            job.state = CANCELLED
            del self._inflight[key]
            self._stats.queued -= 1
            self._stats.cancelled += 1
        job.future.cancel()
        return True

    def promote(self, key: ExpertKey) -> None:
        """A queued read of `key` becomes a demand read (no effect otherwise)."""
        with self._lock:
            job = self._inflight.get(key)
            if job is not None and job.state == QUEUED and job.priority != DEMAND:
                job.priority = DEMAND  # the stale queue entry is skipped when popped
                self._queue.put((DEMAND, next(self._seq), job))

    def read(self, keys: Iterable[ExpertKey], priority: int = DEMAND) -> dict[ExpertKey, Buffer]:
        """Sync: queue every read, then wait for all; raises the first failure after all finished."""
        futs = {k: self.submit(k, priority) for k in keys}
        return _gather(futs)

    async def aread(self, keys: Iterable[ExpertKey], priority: int = DEMAND) -> dict[ExpertKey, Buffer]:
        futs = {k: self.submit(k, priority) for k in keys}
        await asyncio.gather(*(wait_future(f) for f in futs.values()), return_exceptions=True)
        return _gather(futs)

    def reclaim(self, holder: Any, attr: str = "buf", wanted: int = 0) -> bool:
        """Take a record buffer out of `holder.attr` and reuse it if nothing else refers to it
        (`wanted`: see `BufferPool.reclaim`)."""
        return self.pool.reclaim(holder, attr, wanted)

    @property
    def reading(self) -> int:
        """Reads running now, each holding a buffer."""
        return self._stats.inflight

    # ---- the workers ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            prio, _, job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != QUEUED or prio != job.priority:
                    continue  # cancelled, or a superseded entry of a promoted job
                job.state = RUNNING
                self._stats.queued -= 1
                self._stats.inflight += 1
                self._stats.peak_inflight = max(self._stats.peak_inflight, self._stats.inflight)
            buf: Buffer | None = None
            err: BaseException | None = None
            try:
                buf = self._read_verified(job.key, job.loc, job.into)
            except BaseException as e:
                err = e
            with self._lock:
                job.state = DONE
                self._stats.inflight -= 1
                if self._inflight.get(job.key) is job:
                    del self._inflight[job.key]
                if err is not None:
                    self._stats.failed += 1
            if err is not None:
                job.future.set_exception(err)
            else:
                job.future.set_result(buf)  # type: ignore[arg-type]
            del job, buf, err  # an idle worker must not keep the last record alive (buffer reuse)

    def _read_verified(self, key: ExpertKey, loc: RecordLocation, into: Buffer | None = None) -> Buffer:
        if self._read_delay is not None and (delay := self._read_delay()) > 0:
            time.sleep(delay)
        order = self.copies.order(key, loc)
        buf = into if into is not None else self.pool.get()
        problems: list[str] = []
        bad_checksum = False
        for i, copy in enumerate(order):
            t0 = time.perf_counter()
            try:
                self.copies.read(copy, loc, buf)
            except OSError as e:
                with copy.stats_lock:
                    copy.stats.errors += 1
                problems.append(f"{copy.name}: {e.strerror or e}")
                if copy.role == "mirror":
                    self.copies.degrade(copy, f"read of {loc.path} failed ({e.strerror or e})"
                                        if not isinstance(e, CopyMissing) else str(e.strerror))
                else:
                    log.error("read of %s at offset %d failed on the primary: %s", copy.root / loc.path,
                              loc.offset, e)
                continue
            dt = time.perf_counter() - t0
            ok = xxhash.xxh3_64_intdigest(buf[: loc.length].data) == loc.checksum
            with copy.stats_lock:
                copy.stats.reads += 1
                copy.stats.bytes += loc.length
                copy.stats.latency.observe(dt)
                if not ok:
                    copy.stats.checksum_failures += 1
            with self._lock:
                self._stats.reads += 1
                self._stats.bytes += loc.length
                if not ok:
                    self._stats.checksum_failures += 1
                elif i:
                    self._stats.fallbacks += 1
            if ok:
                return buf
            bad_checksum = True
            problems.append(f"{copy.name}: checksum mismatch")
            log.error("checksum mismatch: layer %d expert %d in %s at offset %d (%s)", key[0], key[1],
                      copy.root / loc.path, loc.offset, copy.name)
        if into is None:
            box = Holder(buf)
            del buf
            self.pool.reclaim(box)
        where = f"layer {key[0]} expert {key[1]}: file {self.index.root / loc.path} offset {loc.offset}"
        if bad_checksum:
            with self._lock:
                self._stats.corrupt += 1
            raise DataCorruption(f"expert record failed its xxh3_64 checksum on every copy ({where}; "
                                 f"{'; '.join(problems)})")
        raise Unavailable(f"expert record could not be read from any copy ({where}; {'; '.join(problems)})")

    # ---- bandwidth probe ------------------------------------------------------------
    def probe(self, records: int = 8, seed: int = 0) -> list[float]:
        """Measure each copy's read bandwidth (GB/s) on `records` random records of files it
        holds, read `depth` at a time, and use the figures as placement weights."""
        rng = random.Random(seed)
        weights = []
        for copy in self.copies.copies:
            keys = [k for k, loc in self.index.records.items() if loc.path in copy.fds]
            if not keys or not copy.healthy:
                weights.append(copy.stats.weight)
                continue
            todo = rng.sample(keys, min(records, len(keys)))
            done: list[int] = []
            lock = threading.Lock()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=self._probe_worker, args=(copy, todo, done, lock))
                       for _ in range(min(self.depth, len(todo)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            gbps = sum(done) / max(time.perf_counter() - t0, 1e-9) / 1e9
            weights.append(gbps if done else copy.stats.weight)
            log.info("%s (%s): probed %.2f GB/s", copy.name, copy.root, gbps)
        self.copies.set_weights(weights)
        return weights

    def _probe_worker(self, copy: Copy, todo: list[ExpertKey], done: list[int], lock: threading.Lock) -> None:
        box = Holder(self.pool.get())
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    loc = self.index.records[todo.pop()]
                assert box.buf is not None
                self.copies.read(copy, loc, box.buf)
                with lock:
                    done.append(loc.length)
        except OSError as e:
            log.warning("probe of %s failed: %s", copy.name, e)
        finally:
            self.pool.reclaim(box)

    # ---- stats and shutdown ---------------------------------------------------------
    def stats(self) -> IOStats:
        with self._lock:
            s = IOStats(**{k: getattr(self._stats, k) for k in self._stats.__dataclass_fields__ if k != "disks"},
                        disks=[])
        for c in self.copies.copies:
            with c.stats_lock:
                s.disks.append(c.stats.copy())
        s.buffers_allocated = self.pool.allocated
        s.buffers_reused = self.pool.reused
        return s

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [j for j in self._inflight.values() if j.state == QUEUED]
            for j in pending:
                j.state = CANCELLED
                del self._inflight[j.key]
        for j in pending:
            j.future.set_exception(Unavailable("the I/O engine was closed"))
        for _ in self._workers:
            self._queue.put((_STOP, next(self._seq), None))
        for w in self._workers:
            w.join()
        self.copies.close()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gather(futs: dict[ExpertKey, Future[Buffer]]) -> dict[ExpertKey, Buffer]:
    out: dict[ExpertKey, Buffer] = {}
    first: BaseException | None = None
    for k, f in futs.items():
        try:
            out[k] = f.result()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first
    return out


async def wait_future(fut: Future[Buffer]) -> Buffer:
    """Await a shared concurrent future without letting a cancelled awaiter cancel it
    (asyncio.wrap_future would, failing every other request joined to the read)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def done() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def wake(_: Future[Buffer]) -> None:
        loop.call_soon_threadsafe(done)

    fut.add_done_callback(wake)
    await waiter
    return fut.result()


__all__ = ["DEMAND", "PREFETCH", "CancelledError", "IOEngine", "wait_future"]
