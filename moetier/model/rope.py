"""Rotary position embedding (RoPE), plain or YaRN-scaled, and the attention softmax scale.

Legend: T = rows, n = heads, d = per-head width, r = rotary dims (ModelArgs.rope_dim),
P = r // 2 rotated pairs.

Pair i of a head's first r dims is rotated by angle pos * inv_freq[i]:
  * interleaved (DeepSeek):   pairs (x0, x1), (x2, x3), ...
  * halves (rotate_half):     pairs (x_i, x_{i + r/2})
Dims past r pass through unchanged (partial rotary, GLM-4.5). Queries and keys are rotated
the same way, so any fixed layout of the rotated dims gives the same dot products; this module
keeps each pair where the checkpoint put it.

Angles are computed in float32, as Hugging Face and the reference implementations do, so long
positions round the same way there and here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs
from moetier.model.ops import C_STEPS, plain_f32

F32 = npt.NDArray[np.float32]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _default_inv_freq(base: float, dim: int) -> F32:
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # [P]
    return (np.float32(1.0) / np.power(np.float32(base), exponent)).astype(np.float32)


def _yarn(rp: dict[str, Any], base: float, dim: int, max_positions: int) -> tuple[F32, float]:
    """YaRN (arXiv 2309.00071) as Hugging Face's `_compute_yarn_parameters` computes it."""
    original = int(rp.get("original_max_position_embeddings") or max_positions)
    factor = rp.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention_factor = rp.get("attention_factor")
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(rp.get("beta_fast") or 32)
    beta_slow = float(rp.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)  # [P]: 1 = keep the original frequency
    pos_freqs = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


@dataclass(frozen=True)
class Rope:
    inv_freq: F32  # [P]
    attention_factor: float  # YaRN: multiplies cos and sin (so scores by its square); 1.0 otherwise
    interleave: bool

    @property
    def dim(self) -> int:
        return 2 * len(self.inv_freq)

    @classmethod
    def from_args(cls, args: ModelArgs) -> Rope:
        dim = args.rope_dim
        rp = args.rope_scaling or {}
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind == "default":
            inv, factor = _default_inv_freq(args.rope_theta, dim), 1.0
        elif kind == "linear":
            inv, factor = _default_inv_freq(args.rope_theta, dim) / np.float32(rp["factor"]), 1.0
        elif kind == "yarn":
            inv, factor = _yarn(rp, args.rope_theta, dim, args.max_position_embeddings)
        else:
            raise ValueError(f"rope type {kind!r} is not supported (default, linear, yarn)")
        return cls(inv.astype(np.float32), factor, args.rope_interleave)

    def cos_sin(self, pos: npt.NDArray[np.int64]) -> tuple[F32, F32]:
        """Positions [T] -> cos, sin [T, P] (already scaled by attention_factor)."""
        angles = pos.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, P] in float32
        f = np.float32(self.attention_factor)
        cos = np.cos(angles.astype(np.float64)).astype(np.float32) * f
        sin = np.sin(angles.astype(np.float64)).astype(np.float32) * f
        return cos, sin

    def apply(self, x: F32, cos: F32, sin: F32) -> F32:
        """Rotate the first `dim` dims of every head: x [T, n, d], cos/sin [T, P] -> [T, n, d]."""
        r = self.dim
        rope = C_STEPS.get("rope")
        if (rope is not None and x.ndim == 3 and r <= x.shape[2] and cos.shape == sin.shape == (x.shape[0], r // 2)
                and plain_f32(x) and plain_f32(cos) and plain_f32(sin)):
            y = np.empty_like(x)
            rope(x, cos, sin, x.shape[0], x.shape[1], x.shape[2], r // 2, self.interleave, y)
            return y
        return self.apply_numpy(x, cos, sin)

    def apply_numpy(self, x: F32, cos: F32, sin: F32) -> F32:
        """`apply`'s definition, in numpy."""
        r = self.dim
        out = np.array(x, dtype=np.float32, copy=True)
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, P]
        if self.interleave:
            a, b = x[..., 0:r:2], x[..., 1:r:2]  # [T, n, P]
            out[..., 0:r:2] = a * c - b * s
            out[..., 1:r:2] = b * c + a * s
        else:
            a, b = x[..., : r // 2], x[..., r // 2 : r]  # [T, n, P]
            out[..., : r // 2] = a * c - b * s
            out[..., r // 2 : r] = b * c + a * s
        return out


def softmax_scale(args: ModelArgs) -> float:
    """Attention softmax scale: 1/sqrt(query-key width).

    MLA models (DeepSeek-V2/V3 and their descendants) also multiply it by
    yarn_mscale(factor, mscale_all_dim)^2 when YaRN is on; GQA models do not.
    """
    scale = args.qk_head_dim**-0.5
    rp = args.rope_scaling or {}
    if args.attention == "mla" and rp.get("mscale_all_dim"):
        m = yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"]))
        scale = scale * m * m
    return scale
