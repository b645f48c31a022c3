"""The engine's fast, row-invariant kernels: `FastOps` (the `Ops` protocol) and `warmup()`.

See moetier/kernels/fast.py for the API and moetier/kernels/_ckernels.c for the
arithmetic contract that makes them bit-for-bit row-invariant.
"""

from __future__ import annotations

from moetier.kernels.fast import FastOps, c_available, c_has_simd, c_problem, default_threads, warmup

__all__ = ["FastOps", "c_available", "c_has_simd", "c_problem", "default_threads", "warmup"]
