"""Benchmarks; each module defines `register(subparsers)` for `moetier bench`."""
