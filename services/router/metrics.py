"""The router's Prometheus metrics: this module owns every metric object.

Each router has its own CollectorRegistry (several routers can live in one test
process). Gauges read the live state through callbacks, so there is no copy of it
to keep in step. Labels are bounded: outcome, reason, kind, store (one per expert store of the cluster).

| metric | type | labels | meaning |
|---|---|---|---|
| moetier_router_requests_total | counter | outcome | Generate calls by how they ended: ok, cancelled (by the caller), rejected (queue full), unavailable (no worker, or it failed), invalid (bad request), error (anything else) |
| moetier_router_routed_total | counter | reason | requests sent to a worker, by why that worker: session, prefix, least_load |
| moetier_router_queue_depth | gauge | | requests waiting in the router's queue |
| moetier_router_queue_capacity | gauge | | size of that queue (settings.queue_capacity) |
| moetier_router_queue_time_seconds | histogram | | time requests waited in the router's queue before being sent |
| moetier_router_request_seconds | histogram | | time from the router receiving a request to its stream's end |
| moetier_router_in_flight | gauge | | requests the router has running on workers |
| moetier_router_members | gauge | kind | registered members: dense_worker, expert_store |
| moetier_router_failovers_total | counter | | requests routed again because their worker failed before the first token |
| moetier_router_member_departures_total | counter | reason | members dropped from the routing table: expired (silent), failed (mid-stream), replaced (new address), drained (shutting down) |
| moetier_router_placed_experts | gauge | store | experts the placement map sends to each live expert store first (its share of what it owns) |
| moetier_router_unowned_experts | gauge | | experts some store has owned that no live store owns now (requests needing them fail) |
| moetier_router_placement_version | gauge | | version of the placement map (changes when a store joins, leaves or re-shards) |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.router.registry import LeaveReason, MemberKind
from services.router.scheduler import Reason

OUTCOMES = ("ok", "cancelled", "rejected", "unavailable", "invalid", "error")
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moetier_router_requests", "Generate calls by outcome.", ["outcome"],
                                registry=r)
        self.routed = Counter("moetier_router_routed", "Requests sent to a worker, by routing reason.",
                              ["reason"], registry=r)
        self.queue_depth = Gauge("moetier_router_queue_depth", "Requests waiting in the router queue.",
                                 registry=r)
        self.queue_capacity = Gauge("moetier_router_queue_capacity", "Capacity of the router queue.",
                                    registry=r)
        self.queue_time = Histogram("moetier_router_queue_time_seconds",
                                    "Time requests waited in the router queue.", buckets=_QUEUE_BUCKETS,
                                    registry=r)
        self.request_time = Histogram("moetier_router_request_seconds",
                                      "Time from receiving a request to the end of its stream.",
                                      buckets=_REQUEST_BUCKETS, registry=r)
        self.in_flight = Gauge("moetier_router_in_flight", "Requests running on workers.", registry=r)
        self.members = Gauge("moetier_router_members", "Registered members by kind.", ["kind"], registry=r)
        self.failovers = Counter("moetier_router_failovers",
                                 "Requests routed again after their worker failed before the first token.",
                                 registry=r)
        self.departures = Counter("moetier_router_member_departures",
                                  "Members dropped from the routing table, by reason.", ["reason"],
                                  registry=r)
        self._placement = _PlacementCollector(dict, int, int)  # empty until observe_placement
        r.register(self._placement)
        # Every label value exists from the start, so rates and dashboards see zeros, not gaps.
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        for reason in get_args(Reason):
            self.routed.labels(reason=reason)
        for leave in get_args(LeaveReason):
            self.departures.labels(reason=leave)

    def observe_state(self, queue_depth: Callable[[], int], queue_capacity: int,
                      in_flight: Callable[[], int], members: Callable[[MemberKind], int]) -> None:
        """Point the gauges at the live state."""
        self.queue_depth.set_function(queue_depth)
        self.queue_capacity.set(queue_capacity)
        self.in_flight.set_function(in_flight)
        for kind in MemberKind:
            self.members.labels(kind=kind.value).set_function(lambda k=kind: members(k))  # type: ignore[misc]

    def observe_placement(self, placed: Callable[[], dict[str, int]], unowned: Callable[[], int],
                          version: Callable[[], int]) -> None:
        """Placement per store, read at scrape time (the set of stores changes)."""
        self._placement.point(placed, unowned, version)


class _PlacementCollector(Collector):
    def __init__(self, placed: Callable[[], dict[str, int]], unowned: Callable[[], int],
                 version: Callable[[], int]) -> None:
        self.point(placed, unowned, version)

    def point(self, placed: Callable[[], dict[str, int]], unowned: Callable[[], int],
              version: Callable[[], int]) -> None:
        """Read these at each scrape from now on."""
        self._placed, self._unowned, self._version = placed, unowned, version

    def collect(self) -> Iterator[Metric]:
        per = GaugeMetricFamily("moetier_router_placed_experts",
                                "Experts the placement map sends to each expert store first.", labels=["store"])
        for store, n in sorted(self._placed().items()):
            per.add_metric([store], n)
        yield per
        yield GaugeMetricFamily("moetier_router_unowned_experts",
                                "Experts some store has owned that no live store owns now.", value=self._unowned())
        yield GaugeMetricFamily("moetier_router_placement_version", "Version of the placement map.",
                                value=self._version())
