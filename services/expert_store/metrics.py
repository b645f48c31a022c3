"""The expert store's Prometheus metrics: this module owns every metric object.

Each store has its own CollectorRegistry (several stores can live in one test process).
The tier keeps monotonic counters in plain stats dataclasses (moetier/store/stats.py);
a custom collector reads them once per scrape, so nothing is counted twice and nothing
drifts. What only the service sees (per-call timings, calls, rows, errors) is observed
directly. Labels are bounded: layer (MoE layers), disk (primary, mirror0, ...), policy,
code; never an expert id (per-expert heat is the Heat RPC's snapshot).

| metric | type | labels | meaning |
|---|---|---|---|
| moetier_expert_store_hits_total | counter | layer | experts of a ComputeExperts batch union found in RAM |
| moetier_expert_store_misses_total | counter | layer | experts of a batch union read from disk (or joined to a read in flight) |
| moetier_expert_store_prefetch_useful_total | counter | layer | prefetched experts later demanded |
| moetier_expert_store_prefetch_wasted_total | counter | layer | prefetched experts evicted unused |
| moetier_expert_store_prefetch_hints_total | counter | | experts named by Prefetch hints |
| moetier_expert_store_prefetch_queued_total | counter | | prefetch reads started |
| moetier_expert_store_prefetch_dropped_total | counter | | hinted experts dropped: stale step, prefetch disabled, over the bound, no room, superseded |
| moetier_expert_store_evictions_total | counter | | experts evicted from RAM |
| moetier_expert_store_failed_loads_total | counter | | expert loads that failed (no valid copy, I/O error) |
| moetier_expert_store_resident_bytes | gauge | | bytes of verified experts in RAM |
| moetier_expert_store_resident_experts | gauge | | experts in RAM |
| moetier_expert_store_loading_bytes | gauge | | bytes reserved for reads in flight (resident + loading <= budget) |
| moetier_expert_store_pinned_experts | gauge | | experts in use by running computes |
| moetier_expert_store_budget_bytes | gauge | | RAM tier budget |
| moetier_expert_store_policy_info | gauge | policy | 1 for the replacement policy in use |
| moetier_expert_store_miss_wait_seconds | histogram | | time a batch with misses waited for its reads |
| moetier_expert_store_reads_in_flight | gauge | | record reads being performed now |
| moetier_expert_store_reads_queued | gauge | | record reads waiting for an I/O worker |
| moetier_expert_store_reads_joined_total | counter | | requests that joined a read already in flight (single-flight) |
| moetier_expert_store_reads_submitted_total | counter | | distinct record reads queued, demand and prefetch (a join is not one) |
| moetier_expert_store_read_fallbacks_total | counter | | reads served by another copy than placement chose |
| moetier_expert_store_checksum_failures_total | counter | | record reads that failed their checksum, any copy |
| moetier_expert_store_corrupt_records_total | counter | | reads with no valid copy (DATA_LOSS) |
| moetier_expert_store_disk_reads_total | counter | disk | record reads from this copy |
| moetier_expert_store_disk_read_bytes_total | counter | disk | bytes read from this copy |
| moetier_expert_store_disk_read_errors_total | counter | disk | failed reads (I/O error, missing or removed file) |
| moetier_expert_store_disk_checksum_failures_total | counter | disk | reads from this copy that failed their checksum |
| moetier_expert_store_disk_read_seconds | histogram | disk | latency of one record read from this copy |
| moetier_expert_store_disk_ok | gauge | disk | 1 while the copy serves reads, 0 while degraded |
| moetier_expert_store_disk_weight | gauge | disk | the copy's placement weight (probed GB/s or configured) |
| moetier_expert_store_compute_calls_total | counter | layer | ComputeExperts calls answered |
| moetier_expert_store_compute_rows_total | counter | layer | rows of those calls |
| moetier_expert_store_shared_calls_total | counter | layer | MoE layer calls a dense worker on this host computed itself from this store's shared experts (storage.share), as it reported them |
| moetier_expert_store_shared_rows_total | counter | layer | rows of those calls |
| moetier_expert_store_compute_waves_total | counter | layer | pin-compute-release waves of those calls: one per call whose batch union fits the budget, more when it does not (waves - calls = extra waves) |
| moetier_expert_store_compute_errors_total | counter | code | ComputeExperts calls failed, by gRPC status (invalid_argument, data_loss, ...) |
| moetier_expert_store_compute_seconds | histogram | | time in the expert FFN kernels per call |
| moetier_expert_store_load_seconds | histogram | | time making a call's batch union resident (hits, reads, waits) |
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from moetier.errors import MoetierError
from moetier.rpc.errors import status_code
from moetier.store.stats import DiskStats, TierStats
from moetier.store.stats import Histogram as StatsHistogram

P = "moetier_expert_store_"
ERROR_CODES = ("invalid_argument", "not_found", "resource_exhausted", "unavailable", "data_loss",
               "failed_precondition", "cancelled", "internal")
# A call on a tiny model takes microseconds; a large batch on a big one, tens of milliseconds.
_CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def _histogram(name: str, doc: str, h: StatsHistogram, labels: Sequence[str] = (),
               values: Sequence[str] = (), family: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
    fam = family or HistogramMetricFamily(name, doc, labels=list(labels))
    cum = h.cumulative()
    buckets = [(repr(float(b)), float(c)) for b, c in zip(h.buckets, cum, strict=False)]
    buckets.append(("+Inf", float(cum[-1])))
    fam.add_metric(list(values), buckets, h.sum)
    return fam


class TierCollector(Collector):
    """Reads the tier's stats on each scrape and exports them as they are."""

    def __init__(self, stats: Callable[[], TierStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, per_layer in (
            ("hits", "Experts of a batch union found in RAM.", s.hits),
            ("misses", "Experts of a batch union read from disk (or joined to a read in flight).", s.misses),
            ("prefetch_useful", "Prefetched experts later demanded.", s.prefetch_useful_by_layer),
            ("prefetch_wasted", "Prefetched experts evicted unused.", s.prefetch_wasted_by_layer),
        ):
            c = CounterMetricFamily(P + name, doc, labels=["layer"])
            for layer, v in sorted(per_layer.items()):
                c.add_metric([str(layer)], v)
            yield c
        yield CounterMetricFamily(P + "prefetch_hints", "Experts named by prefetch hints.", s.prefetch_hints)
        yield CounterMetricFamily(P + "prefetch_queued", "Prefetch reads started.", s.prefetch_issued)
        yield CounterMetricFamily(P + "prefetch_dropped", "Hinted experts dropped.", s.prefetch_dropped)
        yield CounterMetricFamily(P + "evictions", "Experts evicted from RAM.", s.evictions)
        yield CounterMetricFamily(P + "failed_loads", "Expert loads that failed.", s.failed_loads)
        yield GaugeMetricFamily(P + "resident_bytes", "Bytes of verified experts in RAM.", s.resident_bytes)
        yield GaugeMetricFamily(P + "resident_experts", "Experts in RAM.", s.resident_experts)
        yield GaugeMetricFamily(P + "loading_bytes", "Bytes reserved for reads in flight.", s.loading_bytes)
        yield GaugeMetricFamily(P + "pinned_experts", "Experts in use by running computes.", s.pinned_experts)
        yield GaugeMetricFamily(P + "budget_bytes", "RAM tier budget.", s.budget_bytes)
        yield _histogram(P + "miss_wait_seconds", "Time a batch with misses waited for its reads.", s.miss_wait)
        if s.io is None:
            return
        io = s.io
        yield GaugeMetricFamily(P + "reads_in_flight", "Record reads being performed.", io.inflight)
        yield GaugeMetricFamily(P + "reads_queued", "Record reads waiting for an I/O worker.", io.queued)
        yield CounterMetricFamily(P + "reads_joined", "Requests that joined a read in flight.", io.joined)
        yield CounterMetricFamily(P + "reads_submitted", "Distinct record reads queued (demand and prefetch).",
                                  io.submitted)
        yield CounterMetricFamily(P + "read_fallbacks", "Reads served by another copy than placement chose.",
                                  io.fallbacks)
        yield CounterMetricFamily(P + "checksum_failures", "Record reads that failed their checksum.",
                                  io.checksum_failures)
        yield CounterMetricFamily(P + "corrupt_records", "Reads with no valid copy.", io.corrupt)
        per_disk: list[tuple[CounterMetricFamily | GaugeMetricFamily, Callable[[DiskStats], float]]] = [
            (CounterMetricFamily(P + "disk_reads", "Record reads from this copy.", labels=["disk"]),
             lambda d: d.reads),
            (CounterMetricFamily(P + "disk_read_bytes", "Bytes read from this copy.", labels=["disk"]),
             lambda d: d.bytes),
            (CounterMetricFamily(P + "disk_read_errors", "Failed reads from this copy.", labels=["disk"]),
             lambda d: d.errors),
            (CounterMetricFamily(P + "disk_checksum_failures", "Reads from this copy that failed their checksum.",
                                 labels=["disk"]), lambda d: d.checksum_failures),
            (GaugeMetricFamily(P + "disk_ok", "1 while the copy serves reads, 0 while degraded.", labels=["disk"]),
             lambda d: 1.0 if d.state == "ok" else 0.0),
            (GaugeMetricFamily(P + "disk_weight", "Placement weight of the copy.", labels=["disk"]),
             lambda d: d.weight),
        ]
        latency = HistogramMetricFamily(P + "disk_read_seconds", "Latency of one record read.", labels=["disk"])
        for d in io.disks:
            for fam, value in per_disk:
                fam.add_metric([d.name], float(value(d)))
            _histogram(P + "disk_read_seconds", "", d.latency, ["disk"], [d.name], family=latency)
        for fam, _ in per_disk:
            yield fam
        yield latency


class StoreMetrics:
    def __init__(self, stats: Callable[[], TierStats], layers: Sequence[int], policy: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(TierCollector(stats))
        self.policy = Gauge(P + "policy_info", "1 for the replacement policy in use.", ["policy"], registry=r)
        self.policy.labels(policy=policy).set(1)
        self.calls = Counter(P + "compute_calls", "ComputeExperts calls answered.", ["layer"], registry=r)
        self.rows = Counter(P + "compute_rows", "Rows of ComputeExperts calls answered.", ["layer"], registry=r)
        self.waves = Counter(P + "compute_waves", "Pin-compute-release waves of ComputeExperts calls answered "
                             "(more than one per call when its batch union exceeds the budget).", ["layer"],
                             registry=r)
        self.errors = Counter(P + "compute_errors", "ComputeExperts calls failed, by gRPC status.", ["code"],
                              registry=r)
        self.compute_time = Histogram(P + "compute_seconds", "Time in the expert FFN kernels per call.",
                                      buckets=_CALL_BUCKETS, registry=r)
        self.load_time = Histogram(P + "load_seconds", "Time making a call's batch union resident.",
                                   buckets=_CALL_BUCKETS, registry=r)
        self.shared_calls = Counter(P + "shared_calls", "MoE layer calls a dense worker on this host computed "
                                    "itself from this store's shared experts (storage.share), as it reported them.",
                                    ["layer"], registry=r)
        self.shared_rows = Counter(P + "shared_rows", "Rows of those calls.", ["layer"], registry=r)
        # Every label value exists from the start, so rates and dashboards see zeros, not gaps.
        # The children per layer, looked up once: a call counts into them without the labels()
        # lookup (its lock, its label checks) three times over.
        self._per_layer = {layer: self._children(layer) for layer in layers}
        for code in ERROR_CODES:
            self.errors.labels(code=code)

    def _children(self, layer: int) -> tuple[Counter, Counter, Counter]:
        return (self.calls.labels(layer=str(layer)), self.rows.labels(layer=str(layer)),
                self.waves.labels(layer=str(layer)))

    def observe_compute(self, layer: int, rows: int, waves: int, load_ns: int, compute_ns: int) -> None:
        children = self._per_layer.get(layer)
        if children is None:  # a layer outside those given (the servicer checks, but say it anyway)
            children = self._per_layer[layer] = self._children(layer)
        calls, rows_c, waves_c = children
        calls.inc()
        rows_c.inc(rows)
        waves_c.inc(waves)
        self.load_time.observe(load_ns / 1e9)
        self.compute_time.observe(compute_ns / 1e9)

    def observe_shared(self, layer: int, calls: int, rows: int) -> None:
        self.shared_calls.labels(layer=str(layer)).inc(calls)
        self.shared_rows.labels(layer=str(layer)).inc(rows)

    @contextlib.contextmanager
    def count_errors(self) -> Iterator[None]:
        """Count a failing ComputeExperts by the status code it will get (the error propagates)."""
        try:
            yield
        except MoetierError as e:
            self.errors.labels(code=status_code(e).name.lower()).inc()
            raise
        except BaseException as e:
            code = "cancelled" if isinstance(e, asyncio.CancelledError) else "internal"
            self.errors.labels(code=code).inc()
            raise

