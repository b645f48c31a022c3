"""Plain stats dataclasses of the expert store, easy to export.

The service's metrics module turns these into Prometheus objects; nothing here
imports prometheus_client. Conventions: counters (`*_total`-like fields) are
monotonic; gauges are current values; per-layer values are dicts keyed by layer
id; latencies are histograms with fixed buckets (seconds, upper bounds, the
last bucket is +Inf) so they map one to one onto a Prometheus histogram.
Every `stats()` call returns a fresh copy that the caller may keep.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

# Upper bounds in seconds: a 4 MiB NVMe read takes ~1-4 ms, a queued one longer.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048,
)

CopyState = Literal["ok", "degraded"]


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = above every bound
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Counts at or below each bound, then the total (Prometheus `le` buckets)."""
        return [int(x) for x in np.cumsum(self.counts)]

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile q (inf when it is in the last)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        acc = 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= rank:
                return self.buckets[i] if i < len(self.buckets) else float("inf")
        return float("inf")

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass
class DiskStats:
    """One copy of the expert files: the primary directory or a mirror."""

    name: str  # "primary", "mirror0", ... (a bounded label)
    path: str
    role: Literal["primary", "mirror"]
    state: CopyState = "ok"
    direct: bool = True  # O_DIRECT reads (False: buffered, page cache)
    weight: float = 1.0  # share of placements (probed bandwidth, GB/s, or configured)
    files: int = 0  # expert files this copy holds (valid size)
    reads: int = 0  # completed record reads
    bytes: int = 0
    errors: int = 0  # reads that failed (I/O error, missing or removed file)
    checksum_failures: int = 0
    degraded_total: int = 0  # times marked degraded
    recovered_total: int = 0  # times a re-probe brought it back
    latency: Histogram = field(default_factory=Histogram)

    def copy(self) -> DiskStats:
        d = DiskStats(**{k: getattr(self, k) for k in self.__dataclass_fields__ if k != "latency"})
        d.latency = self.latency.copy()
        return d


@dataclass
class IOStats:
    depth: int  # worker threads (queue depth)
    disks: list[DiskStats]
    inflight: int = 0  # reads being performed now (gauge)
    queued: int = 0  # reads waiting for a worker (gauge)
    peak_inflight: int = 0
    submitted: int = 0  # distinct reads submitted (after single-flight)
    joined: int = 0  # requests that joined a read already in flight (single-flight)
    cancelled: int = 0  # queued prefetch reads dropped before they started
    reads: int = 0  # record reads performed on any copy, retries included
    bytes: int = 0
    fallbacks: int = 0  # reads served by another copy than the one placement chose
    checksum_failures: int = 0
    corrupt: int = 0  # reads with no valid copy (DataCorruption raised)
    failed: int = 0  # reads that raised (corruption or I/O on every copy)
    buffers_allocated: int = 0
    buffers_reused: int = 0


@dataclass
class TierStats:
    policy: str
    budget_bytes: int
    resident_bytes: int = 0  # verified records in RAM (gauge)
    resident_experts: int = 0
    loading_bytes: int = 0  # reserved for reads in flight (gauge); resident + loading <= budget
    loading_experts: int = 0
    pinned_experts: int = 0  # in use by a running compute (gauge)
    protected_experts: int = 0  # held by the learned policy's hot set (gauge)
    hits: dict[int, int] = field(default_factory=dict)  # per layer: demanded and resident
    misses: dict[int, int] = field(default_factory=dict)  # per layer: demanded and read (or being read)
    evictions: int = 0
    failed_loads: int = 0
    prefetch_hints: int = 0  # experts hinted
    prefetch_issued: int = 0  # prefetch reads started
    prefetch_useful: int = 0  # prefetched, then demanded
    prefetch_wasted: int = 0  # prefetched, then evicted unused
    prefetch_dropped: int = 0  # hints dropped: stale, superseded, over the bound, or no room
    prefetch_useful_by_layer: dict[int, int] = field(default_factory=dict)  # prefetch_useful per layer
    prefetch_wasted_by_layer: dict[int, int] = field(default_factory=dict)  # prefetch_wasted per layer
    miss_wait: Histogram = field(default_factory=Histogram)  # time an acquire waited for its reads
    io: IOStats | None = None

    @property
    def hit_rate(self) -> float:
        h, m = sum(self.hits.values()), sum(self.misses.values())
        return h / (h + m) if h + m else 0.0


# Tier state of one expert in a heat snapshot.
HEAT_DISK, HEAT_LOADING, HEAT_RAM, HEAT_PINNED = 0, 1, 2, 3


@dataclass
class HeatSnapshot:
    """Per-expert usage and placement for the dashboard: rows are `layers`, columns expert ids."""

    layers: npt.NDArray[np.int32]  # [L] MoE layer ids
    uses: npt.NDArray[np.uint32]  # [L, E] demand accesses since start
    state: npt.NDArray[np.uint8]  # [L, E] HEAT_DISK / HEAT_LOADING / HEAT_RAM / HEAT_PINNED

    def to_dict(self) -> dict[str, object]:
        return {"layers": self.layers.tolist(), "uses": self.uses.tolist(), "state": self.state.tolist()}
