"""Subcommands of `moetier`; each module defines `register(subparsers)`."""
