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


def _modules(pkg: ModuleType, only: str | None = None) -> list[ModuleType]:
    """The command modules of `pkg`; only: just the one of that name (if there is one)."""
    names = [m.name for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
             if not m.name.startswith("_") and (only is None or m.name == only)]
    return [importlib.import_module(f"{pkg.__name__}.{n}") for n in names]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, given the command a command line names, of that one
    alone where its module is found by name (`expert-store`: commands/expert_store.py): a
    service's process then imports what it runs, not every command's dependencies (each of the
    five processes of `moetier up` held ~90 MB more with all of them)."""
    parser = argparse.ArgumentParser(
        prog="moetier",
        description="Serve Mixture-of-Experts models far larger than RAM.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mods = _modules(commands, command.replace("-", "_")) if command else []
    for mod in mods:
        mod.register(sub)
    if command not in sub.choices:  # no command named, or not a module's name: all of them
        for mod in _modules(commands):
            if mod not in mods:
                mod.register(sub)
    from moetier.commands._env import describe

    describe(sub)  # each command's --help ends with its settings' environment variables
    return parser


def _command(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option."""
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (a launcher's child), not a call from Python
        die_with_launcher()
    parser = build_parser(_command(sys.argv[1:] if argv is None else argv))
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
