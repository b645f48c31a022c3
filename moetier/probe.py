"""Short measurements of this machine, for `moetier doctor`, `plan` and `tune`: memory bandwidth
(a numpy copy, as `bench compute`), the kernels' GB/s of expert weights (FastOps' expert FFN over
records of a given shape, as `bench compute`), and random expert reads (the store's own I/O engine,
O_DIRECT where the filesystem allows, at the record size and a queue depth). Each runs for about
the seconds it is given; the benchmarks stay the reference measurements.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetier.kernels.fast import FastOps, warmup
from moetier.store.buffers import Holder
from moetier.store.io import IOEngine
from moetier.weights.index import ExpertIndex
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import ExpertWeights, QDType


def memory_gbps(mib: int = 256, rounds: int = 3) -> float:
    """Best of `rounds` copies of `mib` MiB, read + written bytes (as `bench compute`)."""
    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def random_experts(hidden: int, intermediate: int, dtype: QDType, group_size: int, working_set: int,
                   seed: int = 0) -> list[ExpertWeights]:
    from moetier.bench.compute import Shape, make_experts

    return make_experts(Shape(hidden, intermediate, dtype, group_size, "probe"), working_set, seed)


@dataclass(frozen=True)
class KernelRate:
    backend: str
    threads: int
    batch: int
    gbps: float  # expert weight bytes per second through SwiGLU FFNs


def kernel_gbps(experts: list[ExpertWeights], batch: int = 1, seconds: float = 1.0,
                ops: FastOps | None = None) -> KernelRate:
    """FastOps' expert FFN over `experts` (distinct, beyond the CPU caches) for about `seconds`."""
    warmup()
    ops = ops or FastOps()
    x = np.random.default_rng(1).standard_normal((batch, experts[0].gate.shape[1]), dtype=np.float32)
    ops.expert_ffn(x, experts[0])
    done = 0
    t0 = time.perf_counter()
    while True:
        for w in experts:
            ops.expert_ffn(x, w)
            done += w.nbytes
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return KernelRate(ops.backend, ops.threads, batch, done / elapsed / 1e9)


@dataclass(frozen=True)
class DiskRate:
    gbps: float
    direct: bool  # O_DIRECT was used (else buffered reads, possibly from the page cache)
    depth: int
    record_bytes: int
    reads: int
    p50_s: float


def disk_gbps(index: ExpertIndex, depth: int, seconds: float = 3.0, seed: int = 0, direct: bool = True,
              **engine_options: Any) -> DiskRate:
    """Random record reads through the store's I/O engine, `depth` outstanding, for about `seconds`
    (buffered reads start from a cold cache: the record files' pages are evicted first)."""
    keys = list(index.records)
    rng = random.Random(seed)
    if not direct:
        evict_cached([index.root / f for f in index.files])
    with IOEngine(index, depth=depth, direct=direct, probe=False, **engine_options) as engine:
        pending: set[Future[Any]] = set()
        nbytes = reads = 0
        t0 = time.perf_counter()
        while True:
            now = time.perf_counter() - t0
            while now < seconds and len(pending) < 2 * depth:
                k = rng.choice(keys)
                nbytes += index.records[k].length
                pending.add(engine.submit(k))
            if not pending:
                break
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            while done:
                f = done.pop()
                box = Holder(f.result())
                del f  # the future holds the buffer too
                engine.reclaim(box)  # recycled, as the tier recycles evicted records
                reads += 1
        elapsed = time.perf_counter() - t0
        st = engine.stats()
        direct = engine.direct
    lengths = {loc.length for loc in index.records.values()}
    return DiskRate(nbytes / elapsed / 1e9, direct, depth, max(lengths), reads, st.disks[0].latency.quantile(0.5))


def evict_cached(files: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (posix_fadvise DONTNEED: no root needed,
    and nothing else's cache is touched)."""
    for f in files:
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def record_layout(hidden: int, intermediate: int, dtype: QDType = "int4", group_size: int = 64) -> RecordLayout:
    return RecordLayout.build(intermediate, hidden, dtype, group_size)
