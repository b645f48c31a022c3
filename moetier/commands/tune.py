"""`moetier tune [--model DIR]`: measure this machine's fastest safe settings and save them as its
profile in data_dir/profile.json. The dense worker and the expert store read it at start (a flag,
an environment variable or the config file still wins); `moetier plan` takes its measured rates.
Every candidate is checked to give the default's bits on the way (moetier/tune.py); the table
shows each setting's default, its choice and the gain measured between them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moetier.settings import apply_kernel_settings, load_settings, merge_flags


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("tune", help="measure and save this machine's fastest safe "
                                                "settings (kernel threads, I/O depth, O_DIRECT, prefetch depth)")
    p.add_argument("--model", type=Path, help="container to tune on (default: settings model.path, else the demo "
                   "model)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--seconds", type=float, default=1.0, help="measurement time per candidate (default 1)")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per prefetch-depth trial (default 8)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, save nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetier.engine import model_dir
    from moetier.profile import Profile, profile_path, save_profile
    from moetier.tune import tune

    settings = load_settings(args.config, merge_flags(model__path=args.model))
    apply_kernel_settings(settings)  # the kernel path the services will run (kernels.backend)
    model = model_dir(settings, args.model, say=not args.json)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    results, rates = tune(settings, model, seconds=args.seconds, tokens=args.tokens, say=say)
    by = {r.setting.split()[0]: r for r in results}
    prof = Profile(kernel_threads=int(by["kernel_threads"].chosen), queue_depth=int(by["storage.queue_depth"].chosen),
                   direct_io=bool(by["storage.direct_io"].chosen),
                   prefetch_depth=int(by["storage.prefetch_depth"].chosen), memory_gbps=rates["memory_gbps"],
                   compute_gbps=rates["compute_gbps"], compute_gbps_batched=rates["compute_gbps_batched"],
                   disk_gbps=rates["disk_gbps"],
                   gains={r.setting: {"default": r.default, "chosen": r.chosen, "unit": r.unit, "figures": r.figures,
                                      "gain": r.gain, "note": r.note} for r in results})
    where = None if args.dry_run else save_profile(settings, prof)
    if args.json:
        print(json.dumps({"model": str(model), "profile": str(where) if where else None,
                          "settings": prof.gains, "rates": rates}))
        return 0
    print(f"tuned on {model} ({prof.machine})")
    print(f"{'setting':<30} {'default':>8} {'chosen':>8} {'default figure':>15} {'chosen figure':>14} {'gain':>7}  unit")
    for r in results:
        d, c = r.figures.get(str(r.default)), r.figures.get(str(r.chosen))
        print(f"{r.setting:<30} {r.default!s:>8} {r.chosen!s:>8} {d or 0:>15.3f} {c or 0:>14.3f} {r.gain:>+7.1%}  "
              f"{r.unit}" + (f" ({r.note})" if r.note else ""))
    print(f"rates: memory {rates['memory_gbps']:.1f} GB/s, kernels {rates['compute_gbps']:.2f} GB/s at batch 1 and "
          f"{rates['compute_gbps_batched']:.2f} at batch 16, disk {rates['disk_gbps']:.2f} GB/s")
    print("saved " + str(where) if where else "dry run: nothing saved", f"(delete {profile_path(settings)} to go "
          "back to the defaults)" if where else "")
    return 0
