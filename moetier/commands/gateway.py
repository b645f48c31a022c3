"""`moetier gateway`: serve the OpenAI-compatible HTTP API in front of the router."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.settings import Endpoint, load_settings, merge_flags


def run(args: argparse.Namespace) -> int:
    from services.gateway.server import serve  # the service is loaded only by the command that runs it

    settings = load_settings(args.config, merge_flags(model__path=args.model, model__name=args.model_name,
                                                      gateway__bind=args.bind, gateway__api_key=args.api_key))
    if args.router:
        # router is an endpoint without per-field defaults: override its address here, validated.
        settings = settings.model_copy(update={"router": Endpoint(**{**settings.router.model_dump(),
                                                                     "address": args.router})})
    serve(settings)
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--model", type=Path, help="model directory (default: settings model.path, else the demo model)")
    p.add_argument("--model-name", help="model id clients send (default: the directory name)")
    p.add_argument("--bind", help="host:port to listen on (default: settings gateway.bind, 127.0.0.1:8000)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: settings "
                   "gateway.api_key; better: MOETIER_GATEWAY__API_KEY, which stays out of `ps`)")
    p.add_argument("--router", help="router host:port (default: settings router.address)")
    p.set_defaults(func=run)
