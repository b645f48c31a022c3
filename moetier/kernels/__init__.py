"""The engine's fast, row-invariant kernels: `FastOps` (the `Ops` protocol) and `warmup()`.

See moetier/kernels/fast.py for the API and moetier/kernels/csrc/mt.h for the
arithmetic contract that makes them bit-for-bit row-invariant.
"""

from __future__ import annotations

from moetier.kernels.fast import (
    FastOps,
    c_available,
    c_best,
    c_has_simd,
    c_paths,
    c_problem,
    default_threads,
    idle_spin_us,
    park_helpers,
    set_default_activations,
    set_default_backend,
    set_idle_spin,
    warmup,
)

__all__ = ["FastOps", "c_available", "c_best", "c_has_simd", "c_paths", "c_problem", "default_threads",
           "idle_spin_us", "park_helpers", "set_default_activations", "set_default_backend", "set_idle_spin", "warmup"]
