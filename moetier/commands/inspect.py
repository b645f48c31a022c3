"""`moetier inspect DIR`: container summary and quantization error per tensor class."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moetier.convert.inspection import format_report, inspect_container
from moetier.errors import InvalidArgument
from moetier.settings import load_settings


def _run(args: argparse.Namespace) -> int:
    if args.dir is not None and args.model is not None and Path(args.dir) != args.model:
        raise InvalidArgument(f"two containers given: {args.dir} and --model {args.model}")
    path = args.model or args.dir or load_settings(args.config).model.path
    if path is None:
        raise InvalidArgument("give the container: --model DIR (or set model.path)")
    report = inspect_container(str(path), verify=args.verify)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("inspect", help="summarise a container and its quantization error")
    p.add_argument("dir", nargs="?", help="container directory (or --model DIR)")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--verify", action="store_true", help="recheck every checksum")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
