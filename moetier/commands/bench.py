"""`moetier bench <name>`: benchmarks that print their figure beside its limit.

Each benchmark is a module in moetier/bench/ with `register(subparsers)`.
"""

from __future__ import annotations

import argparse
from typing import Any

from moetier import bench
from moetier.cli import _modules


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("bench", help="run a benchmark (io, cache, compute, e2e, peers)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for mod in _modules(bench):
        mod.register(bsub)

    def usage(_: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)
