"""Quantization error per tensor class: relative RMS of the stored tensors against their
float source, with int4 per-group and int4 per-row on the same tensors beside it (the
measured case for group scales).

Sums of squares are kept per class so partial results (one converter shard, one inspected
layer) add up exactly; `summary` turns them into the manifest's `quant_error` entry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.weights.quant import QTensor, dequantize, quantize

F32 = npt.NDArray[np.float32]
CHUNK = 1 << 22  # elements per float64 reduction chunk: bounds temporary memory
METHODS = ("stored", "int4_group", "int4_row")
SAMPLE_ELEMENTS = 1 << 24

Stats = dict[str, dict[str, Any]]  # class -> {"tensors": n, "ref2": s, "<method>": err2}


def experts_sample(n_experts: int, per_layer: int = 4) -> list[int]:
    """Experts of each layer whose error is measured (evenly spaced, deterministic)."""
    step = max(1, n_experts // per_layer)
    return list(range(0, n_experts, step))[:per_layer]


def _sq(a: np.ndarray) -> float:
    flat = a.reshape(-1)
    return float(sum(np.dot(flat[i:i + CHUNK].astype(np.float64), flat[i:i + CHUNK].astype(np.float64))
                     for i in range(0, flat.size, CHUNK)))


def _err2(x: F32, approx: F32) -> float:
    return _sq(approx - x)


def _rows(x: F32, stored: QTensor, limit: int) -> tuple[F32, QTensor]:
    """An evenly spaced row sample of at most `limit` elements (large embeddings, lm_head)."""
    rows = x.shape[0]
    keep = max(1, limit // max(1, x.shape[1]))
    if rows <= keep:
        return x, stored
    idx = np.linspace(0, rows - 1, keep).round().astype(np.int64)
    sc = None if stored.scales is None else np.ascontiguousarray(stored.scales[idx])
    return (np.ascontiguousarray(x[idx]),
            QTensor(stored.dtype, (len(idx), *stored.shape[1:]), np.ascontiguousarray(stored.data[idx]), sc,
                    stored.group_size))


def measure(stats: Stats, cls: str, x: F32, stored: QTensor, group_size: int) -> None:
    """Add one tensor's squared errors to `stats[cls]` (x: float32 [R, C] source; tensors
    over SAMPLE_ELEMENTS are measured on an evenly spaced row sample)."""
    x, stored = _rows(x, stored, SAMPLE_ELEMENTS)
    ent = stats.setdefault(cls, {"tensors": 0, "ref2": 0.0, **{m: 0.0 for m in METHODS}})
    ent["tensors"] += 1
    ent["ref2"] += _sq(x)
    ent["stored"] += _err2(x, dequantize(stored))
    ent["int4_group"] += _err2(x, dequantize(quantize(x, "int4", group_size)))
    cols = x.shape[1] + x.shape[1] % 2
    ent["int4_row"] += _err2(x, dequantize(quantize(x, "int4", cols)))


def merge(into: Stats, other: Stats) -> None:
    for cls, ent in other.items():
        tgt = into.setdefault(cls, {"tensors": 0, "ref2": 0.0, **{m: 0.0 for m in METHODS}})
        for k, v in ent.items():
            tgt[k] += v


def summary(stats: Stats, quantization: dict[str, Any]) -> dict[str, Any]:
    """{class: {"dtype", "group_size", "tensors", "rel_rms", "int4_g<g>_rel_rms", "int4_per_row_rel_rms"}}."""
    g = quantization["group_size"]
    out: dict[str, Any] = {}
    for cls in sorted(stats):
        ent = stats[cls]
        ref = ent["ref2"]

        def rel(err2: float, ref: float = ref) -> float:
            return math.sqrt(err2 / ref) if ref > 0 else 0.0

        out[cls] = {
            "dtype": quantization[cls],
            "group_size": g,
            "tensors": ent["tensors"],
            "rel_rms": rel(ent["stored"]),
            f"int4_g{g}_rel_rms": rel(ent["int4_group"]),
            "int4_per_row_rel_rms": rel(ent["int4_row"]),
        }
    return out
