"""Live figures for the dashboard page from the gateway's own metrics: tokens/s and TTFT
over a short sliding window, plus the stores' hit rate over the same window.

Each /dashboard/stats call takes a sample (counter values and histogram buckets); rates
and quantiles are the differences between the newest sample and the oldest one still in
the window, the way Prometheus' rate() and histogram_quantile() would compute them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.metrics import GatewayMetrics

WINDOW_S = 10.0


@dataclass(frozen=True)
class Buckets:
    """A histogram's cumulative `le` buckets (upper bound -> count), sum and count."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def minus(self, older: Buckets) -> Buckets:
        return Buckets(self.bounds, tuple(a - b for a, b in zip(self.counts, older.counts, strict=True)),
                       self.sum - older.sum, self.count - older.count)

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank q * count (histogram_quantile)."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound  # above the last finite bound: that bound is all we know
                width = count - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, count
        return lower_bound

    def summary(self) -> dict[str, float | None]:
        return {"p50": self.quantile(0.5), "p95": self.quantile(0.95),
                "mean": self.sum / self.count if self.count > 0 else None, "count": self.count}


@dataclass(frozen=True)
class Sample:
    t: float
    generated_tokens: float
    ttft: Buckets
    itl: Buckets
    hits_misses: tuple[float, float] | None  # None: no store answered


def _value(metrics: GatewayMetrics, sample: str) -> float:
    return metrics.registry.get_sample_value(sample) or 0.0


def buckets_of(metrics: GatewayMetrics, name: str) -> Buckets:
    bounds: list[float] = []
    counts: list[float] = []
    total = count = 0.0
    for family in metrics.registry.collect():
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == f"{name}_bucket":
                bounds.append(float(s.labels["le"]))
                counts.append(s.value)
            elif s.name == f"{name}_sum":
                total = s.value
            elif s.name == f"{name}_count":
                count = s.value
    return Buckets(tuple(bounds), tuple(counts), total, count)


@dataclass
class LiveStats:
    metrics: GatewayMetrics
    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _samples: deque[Sample] = field(default_factory=deque)

    def sample(self, hits_misses: tuple[float, float] | None) -> Sample:
        m = self.metrics
        s = Sample(self.clock(), _value(m, "moetier_gateway_generation_tokens_total"),
                   buckets_of(m, "moetier_gateway_time_to_first_token_seconds"),
                   buckets_of(m, "moetier_gateway_inter_token_latency_seconds"), hits_misses)
        self._samples.append(s)
        # Keep one sample at least window_s old, so the window is always covered when it can be.
        while len(self._samples) > 2 and self._samples[1].t <= s.t - self.window_s:
            self._samples.popleft()
        return s

    def report(self, hits_misses: tuple[float, float] | None) -> dict[str, object]:
        new = self.sample(hits_misses)
        old = self._samples[0]
        span = new.t - old.t
        out: dict[str, object] = {
            "window_s": round(span, 3),
            "generated_tokens": new.generated_tokens,
            "running_requests": _value(self.metrics, "moetier_gateway_running_requests"),
            "tokens_per_s": (new.generated_tokens - old.generated_tokens) / span if span > 0 else None,
            # Over the window when it saw requests, else since start (the page says which).
            "ttft_s": _windowed(new.ttft, old.ttft),
            "inter_token_s": _windowed(new.itl, old.itl),
            "hit_rate": None,
            "hit_rate_total": None,
        }
        if new.hits_misses is not None:
            h, m = new.hits_misses
            out["hit_rate_total"] = h / (h + m) if h + m > 0 else None
            if old.hits_misses is not None and span > 0:
                dh, dm = h - old.hits_misses[0], m - old.hits_misses[1]
                out["hit_rate"] = dh / (dh + dm) if dh + dm > 0 else None
        return out


def _windowed(new: Buckets, old: Buckets) -> dict[str, object]:
    recent = new.minus(old)
    if recent.count > 0:
        return {**recent.summary(), "over": "window"}
    return {**new.summary(), "over": "start"}
