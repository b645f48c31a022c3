"""Quantized tensors: the in-memory form of every stored matrix.

A `QTensor` is a 2-D matrix [R, C] (rows = outputs, columns = inputs) or a 1-D
vector stored in one of four dtypes:

    f32   data float32 [R, C]
    bf16  data uint16  [R, C]              (bfloat16 bit patterns; numpy has no bf16)
    int8  data int8    [R, Cp]             scales float16 [R, Cp // g]
    int4  data uint8   [R, Cp // 2]        scales float16 [R, Cp // g]

Quantization is symmetric with one scale per group of g consecutive input
values of a row (g = 64 by default; g = C is "per-row"). Cp is C rounded up to
a multiple of g; padded columns hold zeros. int4 packs two values per byte:
column 2j in the low nibble, 2j+1 in the high nibble, each stored as q + 8
with q in [-7, 7]. Value = q * scale, computed in float32.

Scales are float16 to keep int4 records small (6% overhead at g = 64);
quantization uses the rounded float16 scale, so dequantization is exact to
what the quantizer decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

QDType = Literal["f32", "bf16", "int8", "int4"]
QDTYPES: tuple[QDType, ...] = ("f32", "bf16", "int8", "int4")
QMAX = {"int8": 127, "int4": 7}
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class QTensor:
    dtype: QDType
    shape: tuple[int, ...]  # logical shape: (R, C) or (N,)
    data: np.ndarray
    scales: np.ndarray | None = None  # float16 [R, Cp // g] for int8/int4
    group_size: int = 0  # g for int8/int4, 0 otherwise

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0))

    @property
    def padded_cols(self) -> int:
        """Cp: columns as stored (C rounded up to a multiple of g for quantized dtypes)."""
        if self.dtype in ("f32", "bf16"):
            return self.shape[-1]
        return _padded(self.shape[-1], self.group_size)

    def dequantize(self) -> npt.NDArray[np.float32]:
        return dequantize(self)


def _padded(cols: int, group_size: int) -> int:
    return -(-cols // group_size) * group_size


def bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, round to nearest even (NaN kept NaN)."""
    a = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = a + np.uint32(0x7FFF) + ((a >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize(w: npt.ArrayLike, dtype: QDType, group_size: int = DEFAULT_GROUP_SIZE) -> QTensor:
    """Quantize a float matrix [R, C] (or vector, f32/bf16 only) to `dtype`."""
    a = np.asarray(w, dtype=np.float32)
    if dtype == "f32":
        return QTensor("f32", a.shape, np.ascontiguousarray(a))
    if dtype == "bf16":
        return QTensor("bf16", a.shape, bf16_bits(a))
    if dtype not in QMAX:
        raise ValueError(f"unknown quantization dtype {dtype!r}; expected one of {QDTYPES}")
    if a.ndim != 2:
        raise ValueError(f"{dtype} quantization needs a 2-D matrix, got shape {a.shape}")
    if group_size <= 0 or (dtype == "int4" and group_size % 2):
        raise ValueError(f"invalid group size {group_size} for {dtype}")
    rows, cols = a.shape
    cp = _padded(cols, group_size)
    if cp != cols:
        a = np.pad(a, ((0, 0), (0, cp - cols)))
    g = a.reshape(rows, cp // group_size, group_size)  # [R, G, g]
    qmax = QMAX[dtype]
    amax = np.abs(g).max(axis=-1)  # [R, G]
    scales = (amax / qmax).astype(np.float16)
    s32 = scales.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)[..., None]
    q = np.clip(np.rint(g / safe), -qmax, qmax).astype(np.int8).reshape(rows, cp)  # [R, Cp]
    if dtype == "int8":
        return QTensor("int8", (rows, cols), q, scales, group_size)
    u = (q + 8).astype(np.uint8)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)  # [R, Cp // 2]
    return QTensor("int4", (rows, cols), packed, scales, group_size)


def unpack_int4(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.int8]:
    """[R, Cp // 2] packed nibbles -> [R, Cp] int8 values in [-8, 7]."""
    lo = (packed & 0x0F).astype(np.int8) - 8
    hi = (packed >> 4).astype(np.int8) - 8
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
    out[:, 0::2] = lo
    out[:, 1::2] = hi
    return out


def dequantize(t: QTensor) -> npt.NDArray[np.float32]:
    """The plain reference: QTensor -> float32 of its logical shape."""
    if t.dtype == "f32":
        return np.asarray(t.data, dtype=np.float32)
    if t.dtype == "bf16":
        return bf16_to_f32(t.data)
    assert t.scales is not None
    q = unpack_int4(t.data) if t.dtype == "int4" else t.data
    rows, cp = q.shape
    g = q.reshape(rows, cp // t.group_size, t.group_size).astype(np.float32)
    w = (g * t.scales.astype(np.float32)[..., None]).reshape(rows, cp)
    return np.ascontiguousarray(w[:, : t.shape[1]])


def quantized_nbytes(shape: tuple[int, ...], dtype: QDType, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[int, int]:
    """(data bytes, scale bytes) of a tensor of `shape` stored as `dtype`."""
    n = int(np.prod(shape))
    if dtype == "f32":
        return 4 * n, 0
    if dtype == "bf16":
        return 2 * n, 0
    rows, cols = shape
    cp = _padded(cols, group_size)
    data = rows * cp if dtype == "int8" else rows * cp // 2
    return data, rows * (cp // group_size) * 2


def relative_rms_error(ref: npt.ArrayLike, approx: npt.ArrayLike) -> float:
    """||approx - ref||_2 / ||ref||_2 (0 when ref is all zeros and approx equals it)."""
    r = np.asarray(ref, dtype=np.float64)
    a = np.asarray(approx, dtype=np.float64)
    den = float(np.sqrt(np.mean(r * r)))
    num = float(np.sqrt(np.mean((a - r) ** 2)))
    return num / den if den > 0 else num


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: SwiGLU FFN  y = down(silu(gate x) * up x)."""

    gate: QTensor  # [I, D]
    up: QTensor  # [I, D]
    down: QTensor  # [D, I]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes
