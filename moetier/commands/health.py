"""`moetier health ADDRESS`: exit 0 when a moetier service is healthy (container healthchecks)."""

from __future__ import annotations

import argparse
from typing import Any

from moetier.launch import grpc_healthy, http_healthy


def run(args: argparse.Namespace) -> int:
    ok = http_healthy(args.address, args.timeout) if args.http else grpc_healthy(args.address, args.timeout)
    if not ok:
        print(f"{args.address}: not healthy")
    return 0 if ok else 1


def register(sub: Any) -> None:
    p = sub.add_parser("health", help="check a service: gRPC health (host:port) or HTTP (--http URL)")
    p.add_argument("address", help="host:port of a gRPC service, or a URL with --http")
    p.add_argument("--http", action="store_true", help="ADDRESS is an HTTP URL that must answer 200")
    p.add_argument("--timeout", type=float, default=2.0)
    p.set_defaults(func=run)
