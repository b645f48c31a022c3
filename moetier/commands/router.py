"""`moetier router`: run the router (cluster registry and request scheduler)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from moetier.settings import Endpoint, load_settings, merge_flags


def run(args: argparse.Namespace) -> int:
    from services.router.server import serve  # the service is loaded only by the command that runs it

    settings = load_settings(args.config)
    flags = merge_flags(bind=args.bind, metrics_port=args.metrics_port)
    if flags:
        # Flags override single fields of the endpoint; load_settings would need the whole
        # endpoint (its fields have no per-field defaults), so they are applied here, validated.
        endpoint = Endpoint(**{**settings.router.model_dump(), **flags})
        settings = settings.model_copy(update={"router": endpoint})
    asyncio.run(serve(settings))
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "router", help="run the router: registry of workers and stores, request scheduling")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--bind", help="host:port to listen on (default: settings router.bind)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics (0: none; default: settings "
                   "router.metrics_port)")
    p.set_defaults(func=run)
