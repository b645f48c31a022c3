"""Channel options every long-lived gRPC channel between the services takes.

gRPC's default reconnect backoff grows to 120 s: a channel whose peer was down for a few
seconds may wait many more before it tries again, failing calls fast meanwhile. Between the
services a restarted peer is found within a second instead.
"""

from __future__ import annotations

RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
