"""The gateway's Prometheus metrics; this module owns every metric object.

Every metric is documented in docs/gateway.md (a test keeps the table complete). Names
are moetier_gateway_<name>_<unit>; labels are bounded (finish_reason, endpoint, status).
Each app has its own registry, so several apps (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
            2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "error", "abort")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/models", "/health", "/metrics")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.time_to_first_token = Histogram(
            "moetier_gateway_time_to_first_token_seconds",
            "Seconds from accepting a generation request to receiving its first token.",
            buckets=_LATENCY, registry=r)
        self.inter_token_latency = Histogram(
            "moetier_gateway_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request.", buckets=_LATENCY, registry=r)
        self.e2e_request_latency = Histogram(
            "moetier_gateway_e2e_request_latency_seconds",
            "Seconds from accepting a generation request to its end.", buckets=_REQUEST, registry=r)
        self.queue_time = Histogram(
            "moetier_gateway_queue_time_seconds",
            "Seconds a request waited in router and worker queues before its first step.",
            buckets=_REQUEST, registry=r)
        self.prompt_tokens = Counter(
            "moetier_gateway_prompt_tokens", "Prompt tokens of generations started.", registry=r)
        self.generation_tokens = Counter(
            "moetier_gateway_generation_tokens", "Tokens generated.", registry=r)
        self.finished_requests = Counter(
            "moetier_gateway_finished_requests", "Generations by how they ended (stop, length, error, "
            "abort = the client went away).", ["finish_reason"], registry=r)
        self.http_requests = Counter(
            "moetier_gateway_http_requests", "HTTP responses by endpoint and status code.",
            ["endpoint", "status"], registry=r)
        self.running_requests = Gauge(
            "moetier_gateway_running_requests", "Generations in flight.", registry=r)
        for reason in FINISH_REASONS:
            self.finished_requests.labels(reason)

    def count_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
