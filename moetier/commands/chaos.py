"""`moetier chaos`: the fault matrix (docs/reliability.md) against a cluster of the demo model."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from moetier.errors import InvalidArgument


def duration(text: str) -> float:
    """`30m`, `90s`, `1h`, or seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 90s, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def run(args: argparse.Namespace) -> int:
    from moetier.chaos import harness, soak

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    root = args.dir or Path(tempfile.mkdtemp(prefix="moetier-chaos-"))
    # progress: on stdout with the table, on stderr when stdout is the JSON report
    out = sys.stderr if args.json else sys.stdout
    echo = lambda s: print(s, file=out, flush=True)  # noqa: E731
    if args.soak is not None:
        rep: dict[str, Any] = asyncio.run(soak.run_soak(root, args.soak, args.window, args.fault_every,
                                                        echo=echo))
        print(json.dumps(rep, indent=2) if args.json else soak.format_soak(rep), flush=True)
        return 0 if rep["passed"] else 1
    names = [n.strip() for n in args.faults.split(",") if n.strip()] if args.faults else None
    if names is not None and not names:
        raise InvalidArgument("--faults: no fault named")
    cases = harness.select(names, args.short, pairs=not args.no_pairs)
    plan = harness.Plan.short() if args.short else harness.Plan()
    print(harness.HEADER, file=out, flush=True)
    rep = asyncio.run(harness.run_matrix(root, cases, plan, echo=echo))
    print(json.dumps(rep, indent=2) if args.json else harness.format_table(rep), flush=True)
    return 0 if rep["passed"] else 1


def register(sub: Any) -> None:
    p = sub.add_parser("chaos", help="inject faults into a cluster of the demo model under load and check "
                       "every request (docs/reliability.md)")
    p.add_argument("--faults", help="comma-separated faults to run (a pair as A+B); default: the whole matrix "
                   "and its pairs")
    p.add_argument("--short", action="store_true", help="the CI form: a few faults, one pair, a smaller workload")
    p.add_argument("--no-pairs", action="store_true", help="single faults only")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dir", type=Path, help="run directory (config, demo model, logs); default: a new temporary one")
    p.add_argument("--soak", type=duration, metavar="DURATION", help="soak instead: mixed traffic with periodic "
                   "faults for DURATION (30m, 2h, 600s)")
    p.add_argument("--window", type=duration, default=300.0, help="soak: latency and resource window (default 5m)")
    p.add_argument("--fault-every", type=duration, default=120.0, help="soak: seconds between faults (default 2m)")
    p.set_defaults(func=run)
