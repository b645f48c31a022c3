"""`moetier doctor [--model DIR] [--deep]`: is this machine, this disk, this container and this
config fit to serve? One line per check (ok, warn or FAIL, with the fix), then the snippets that
point the OpenAI SDK, Claude Code, Codex and curl at this server. Exit 1 on any failure.

Checks (moetier/doctor.py): CPU features and the FastOps backend with a 1-second kernel probe,
free disk, O_DIRECT and io_uring on the model's filesystem; the model's disk (virtual, SATA,
rotational or network, and 3 s of random O_DIRECT reads at the record size and the store's
queue depth against 1 GB/s); the container (checksums, `--deep` reads everything; dense and
experts apart; the MTP head's precision; per-row int4 experts; tokenizer and chat template);
the config (the expert cache against RAM, mirrors valid and on devices of their own, bind
addresses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetier.settings import apply_kernel_settings, load_settings, merge_flags

if TYPE_CHECKING:  # moetier.doctor loads when the command runs (every `moetier` call builds the parser)
    from moetier.doctor import Check

MARK = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("doctor", help="check the machine, disk, container and config "
                                                "before serving; print client snippets")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--deep", action="store_true", help="read every file and expert record against its checksum")
    p.add_argument("--no-disk", action="store_true", help="skip the random-read test of the model's disk")
    p.add_argument("--no-kernels", action="store_true", help="skip the 1-second kernel probe")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _line(c: Check) -> str:
    fix = f"\n        fix: {c.fix}" if c.fix and c.status != "ok" else ""
    return f"{MARK[c.status]}  {c.group:<9} {c.name}: {c.message}{fix}"


def run(args: argparse.Namespace) -> int:
    from moetier.doctor import FAIL, WARN, client_snippets, run_checks

    settings = load_settings(args.config, merge_flags(model__path=args.model))
    apply_kernel_settings(settings)  # the kernel path the services will run (kernels.backend)
    model = settings.model.path.expanduser() if settings.model.path is not None else None
    show = None if args.json else (lambda c: print(_line(c), flush=True))
    checks = run_checks(settings, model, deep=args.deep, disk=not args.no_disk, kernels=not args.no_kernels,
                        progress=show)
    name = settings.model.name or (model.name if model is not None else "demo")
    snippets = client_snippets(settings, name)
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    if args.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks], "clients": snippets, "failures": failed,
                          "warnings": warned, "ok": failed == 0}))
    else:
        print(f"\n{len(checks)} checks: {len(checks) - failed - warned} ok, {warned} warnings, {failed} failures")
        print("\nclients (the key is read from its variable, never written here):")
        for title, key in (("OpenAI SDK (Python)", "openai"), ("Claude Code", "claude_code"), ("Codex", "codex"),
                           ("curl", "curl")):
            print(f"--- {title}\n{snippets[key]}")
        sys.stdout.flush()
    return 1 if failed else 0
