"""`moetier expert-store`: serve a container's routed experts (RAM tier over NVMe + compute)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from moetier.profile import apply_profile
from moetier.settings import Settings, address_from_bind, apply_kernel_settings, load_settings, merge_flags


def build_settings(args: argparse.Namespace) -> Settings:
    """Flags > env > config file > defaults, built once."""
    settings = load_settings(args.config, merge_flags(
        model__path=args.model, model__expert_cache=args.budget, cache__policy=args.policy,
        storage__mirrors=args.mirror, storage__direct_io=False if args.buffered else None,
        storage__queue_depth=args.queue_depth, router__address=args.router,
        expert_store__bind=args.bind, expert_store__metrics_port=args.metrics_port, expert_store__id=args.id))
    settings = address_from_bind(settings, "expert_store", args.bind)
    settings = apply_profile(settings)  # `moetier tune`'s choices where nothing else set them
    return settings


def run(args: argparse.Namespace) -> int:
    from services.expert_store.server import serve  # the service is loaded only by the command that runs it

    settings = build_settings(args)
    apply_kernel_settings(settings)
    asyncio.run(serve(settings))
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "expert-store", help="serve a model's routed experts: RAM tier over NVMe (+ mirrors) and expert compute")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path)")
    p.add_argument("--budget", help="RAM tier budget: bytes (2GiB) or a share of the expert bytes (25%%) "
                   "(default: settings model.expert_cache)")
    p.add_argument("--policy", choices=("lru", "lfu", "learned"), help="replacement policy (default: settings "
                   "cache.policy)")
    p.add_argument("--mirror", type=Path, action="append", metavar="DIR", help="a full or partial copy of the "
                   "container's experts (repeatable; default: settings storage.mirrors)")
    p.add_argument("--buffered", action="store_true", help="read through the page cache instead of O_DIRECT")
    p.add_argument("--queue-depth", type=int, metavar="N", help="concurrent expert reads (default: settings "
                   "storage.queue_depth)")
    p.add_argument("--bind", help="host:port to listen on (default: settings expert_store.bind)")
    p.add_argument("--metrics-port", type=int, metavar="N", help="port of /metrics (0: none; default: settings "
                   "expert_store.metrics_port)")
    p.add_argument("--router", metavar="HOST:PORT", help="router to register with (default: settings "
                   "router.address; '' for none)")
    p.add_argument("--id", help="name to register under (default: settings expert_store.id)")
    p.set_defaults(func=run)
