"""`moetier dense-worker`: run a dense worker (attention, gates, KV and prefix cache, sampling,
continuous batching) against an expert store."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from moetier.profile import apply_profile
from moetier.settings import Settings, address_from_bind, apply_kernel_settings, load_settings, merge_flags


def build_settings(args: argparse.Namespace) -> Settings:
    """Flags > env > config file > defaults, built once; no model given: the demo model."""
    from moetier.engine import model_dir

    settings = load_settings(args.config, merge_flags(
        model__path=args.model, expert_store__address=args.store, router__address=args.router,
        dense_worker__bind=args.bind, dense_worker__metrics_port=args.metrics_port, dense_worker__id=args.id))
    settings = address_from_bind(settings, "dense_worker", args.bind)
    settings = apply_profile(settings)  # `moetier tune`'s choices where nothing else set them
    if settings.model.path is None:
        settings = settings.model_copy(update={"model": settings.model.model_copy(
            update={"path": model_dir(settings, None)})})
    return settings


def run(args: argparse.Namespace) -> int:
    from services.dense_worker.server import serve  # the service is loaded only by the command that runs it

    settings = build_settings(args)
    apply_kernel_settings(settings)
    asyncio.run(serve(settings))
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "dense-worker", help="run a dense worker: attention, gates, KV/prefix cache, sampling, continuous batching")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path, else the demo "
                   "model, built once under data_dir/models/demo)")
    p.add_argument("--store", metavar="HOST:PORT", help="expert store (default: settings expert_store.address)")
    p.add_argument("--router", metavar="HOST:PORT", help="router to register with (default: settings "
                   "router.address; '' for none)")
    p.add_argument("--bind", help="host:port to listen on (default: settings dense_worker.bind)")
    p.add_argument("--metrics-port", type=int, metavar="N", help="port of /metrics (0: none; default: settings "
                   "dense_worker.metrics_port)")
    p.add_argument("--id", help="name to register under (default: settings dense_worker.id)")
    p.set_defaults(func=run)
