"""`moetier inspect DIR`: container summary and quantization error per tensor class."""

from __future__ import annotations

import argparse
import json
from typing import Any

from moetier.convert.inspection import format_report, inspect_container


def _run(args: argparse.Namespace) -> int:
    report = inspect_container(args.dir, verify=args.verify)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("inspect", help="summarise a container and its quantization error")
    p.add_argument("dir", help="container directory")
    p.add_argument("--verify", action="store_true", help="recheck every checksum")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
