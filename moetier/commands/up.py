"""`moetier up`: run the whole cluster locally (router, expert store, dense worker, gateway)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.launch import ensure_model, run_cluster
from moetier.settings import load_settings, merge_flags


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, merge_flags(model__path=args.model))
    if args.prepare:
        print(ensure_model(settings), flush=True)
        return 0
    return run_cluster(settings, args.config, start_timeout_s=args.start_timeout)


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start router, expert store, dense worker and gateway on this machine")
    p.add_argument("--model", type=Path, help="container to serve (default: settings model.path, else the "
                   "demo model, built on first use)")
    p.add_argument("--config", type=Path, help="YAML config file (see docs/config.md)")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds each service may take to "
                   "become healthy")
    p.add_argument("--prepare", action="store_true", help="only make the model ready, as up does before it "
                   "starts anything (model.path checked, else the demo model built under data_dir/models/demo), "
                   "print its path and exit: the init step of docker-compose.yml and deploy/kubernetes/")
    p.set_defaults(func=run)
