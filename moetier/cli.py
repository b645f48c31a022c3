"""The `moetier` command.

Each subcommand lives in its own module under moetier/commands/ (and each
benchmark under moetier/bench/) and exposes `register(subparsers)`, which adds
its parser and sets `func(args) -> int`. Modules are discovered, so adding a
command never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from types import ModuleType

from moetier import commands
from moetier.errors import MoetierError
from moetier.lifeline import die_with_launcher


def _modules(pkg: ModuleType) -> list[ModuleType]:
    return [
        importlib.import_module(f"{pkg.__name__}.{m.name}")
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
        if not m.name.startswith("_")
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetier",
        description="Serve Mixture-of-Experts models far larger than RAM.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _modules(commands):
        mod.register(sub)
    from moetier.commands._env import describe

    describe(sub)  # each command's --help ends with its settings' environment variables
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (a launcher's child), not a call from Python
        die_with_launcher()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MoetierError as e:
        print(f"moetier {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"moetier {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
