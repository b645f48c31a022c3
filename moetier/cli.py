"""The `moetier` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("moetier: not yet wired", file=sys.stderr)
    return 2
