#!/usr/bin/env python3
"""The long fuzzing runs: the targets of tests/test_fuzz_*.py with many more examples than the
suite gives them, randomized (a seed makes a run reproducible), and a table of how many cases
each target ran and how it ended.

    python scripts/fuzz.py                      # 1000 examples per target, a random seed
    python scripts/fuzz.py --examples 5000 --seed 7 -k "container or rpc"
    python scripts/fuzz.py --files              # only the files: container, prefix cache, history

A failure prints hypothesis' minimal failing input (and how to reproduce it); make it a
regression test in tests/test_fuzz_regressions.py when fixing it. docs/reliability.md lists the
targets and the figures of the last recorded runs.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {
    "container": "tests/test_fuzz_container.py",
    "files": "tests/test_fuzz_files.py",
    "rpc": "tests/test_fuzz_rpc.py",
    "gateway": "tests/test_fuzz_gateway.py",
}
# --hypothesis-show-statistics: "tests/x.py::test_y:", then per phase "- N passing, M failing, and K invalid ..."
_TEST = re.compile(r"^(tests/\S+::\S+):\s*$")
_COUNT = re.compile(r"- (\d+) passing, (\d+) failing, and (\d+) invalid")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--examples", type=int, default=1000, help="examples per target (default 1000)")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: a random one, printed)")
    p.add_argument("-k", dest="select", help="pytest -k expression over the targets' names")
    for name in MODULES:
        p.add_argument(f"--{name}", action="store_true", help=f"only {MODULES[name]} (several may be given)")
    a = p.parse_args(argv)
    if a.examples < 1:
        p.error("--examples must be >= 1")
    seed = a.seed if a.seed is not None else random.randrange(2**31)
    chosen = [path for name, path in MODULES.items() if getattr(a, name)] or list(MODULES.values())
    env = {**os.environ, "MOETIER_FUZZ_EXAMPLES": str(a.examples), "MOETIER_FUZZ_SEED": str(seed)}
    cmd = [sys.executable, "-m", "pytest", *chosen, "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "--hypothesis-show-statistics", *(["-k", a.select] if a.select else [])]
    print(f"fuzzing {len(chosen)} modules, {a.examples} examples per target, seed {seed}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    counts: dict[str, list[int]] = {}
    current = None
    for line in proc.stdout.splitlines():
        if m := _TEST.match(line.strip()):
            current = m.group(1)
            counts.setdefault(current, [0, 0, 0])
        elif (m := _COUNT.search(line)) and current is not None:
            for i in range(3):  # summed over the phases (reuse, generate, shrink)
                counts[current][i] += int(m.group(i + 1))
    rows = [(name, *c) for name, c in counts.items()]
    if proc.returncode:
        print(proc.stdout[-20000:])
        print(proc.stderr[-5000:], file=sys.stderr)
    width = max((len(r[0]) for r in rows), default=10)
    print(f"\n{'target':{width}s}  {'passing':>8s}  {'failing':>7s}  {'invalid':>7s}")
    for name, ok, bad, invalid in rows:
        print(f"{name:{width}s}  {ok:8d}  {bad:7d}  {invalid:7d}")
    total = sum(r[1] + r[2] for r in rows)
    verdict = "no failure" if proc.returncode == 0 else f"FAILED (pytest exit {proc.returncode})"
    print(f"\n{len(rows)} targets, {total} cases, {elapsed:.0f} s, seed {seed}: {verdict}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
