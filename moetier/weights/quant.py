"""Quantized tensors: the in-memory form of every stored matrix.

A `QTensor` is a 2-D matrix [R, C] (rows = outputs, columns = inputs) or a 1-D
vector stored in one of four dtypes:

    f32   data float32 [R, C]
    bf16  data uint16  [R, C]              (bfloat16 bit patterns; numpy has no bf16)
    int8  data int8    [R, Cp]             scales float16 [R, Cp // g]
    int4  data uint8   [R, Cp // 2]        scales float16 [R, Cp // g]
    mxfp4 data uint8   [R, Cp // 2]        scales uint8 (e8m0) [R, Cp // 32], g = 32

Quantization is symmetric with one scale per group of g consecutive input
values of a row (g = 64 by default; g = C is "per-row"). Cp is C rounded up to
a multiple of g; padded columns hold zeros. int4 packs two values per byte:
column 2j in the low nibble, 2j+1 in the high nibble, each stored as q + 8
with q in [-7, 7]. Value = q * scale, computed in float32.

Scales are float16 to keep int4 records small (6% overhead at g = 64);
quantization uses the rounded float16 scale, so dequantization is exact to
what the quantizer decided.

mxfp4 is the OCP microscaling FP4 format gpt-oss ships its experts in, kept as
it is (4.25 bits per weight): nibbles packed like int4 (column 2j low, 2j+1
high), each an e2m1 value (sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, -0 included), one e8m0 scale
2^(e - 127) per 32 columns (e = 0: 2^-127, a float32 subnormal; e = 255: NaN).
Value = e2m1 * scale, exact in float32 (or an IEEE overflow to inf at e = 254).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

QDType = Literal["f32", "bf16", "int8", "int4", "mxfp4"]
QDTYPES: tuple[QDType, ...] = ("f32", "bf16", "int8", "int4", "mxfp4")
QMAX = {"int8": 127, "int4": 7}
DEFAULT_GROUP_SIZE = 64
MXFP4_GROUP = 32  # values per e8m0 scale (the OCP MX block)
# e2m1 code -> value; codes 8..15 are the negatives of 0..7 (8 is -0.0)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)


def e8m0_to_f32(e: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """e8m0 scale bytes -> 2^(e - 127) as float32 (0: the subnormal 2^-127; 255: NaN)."""
    u = np.asarray(e, dtype=np.uint32)
    bits = np.where(u == 0, np.uint32(0x00400000), u << np.uint32(23))
    bits = np.where(u == 255, np.uint32(0x7FC00000), bits).astype(np.uint32)
    return bits.view(np.float32)


@dataclass(frozen=True)
class QTensor:
    dtype: QDType
    shape: tuple[int, ...]  # logical shape: (R, C) or (N,)
    data: np.ndarray
    scales: np.ndarray | None = None  # float16 [R, Cp // g] for int8/int4, uint8 e8m0 for mxfp4
    group_size: int = 0  # g for int8/int4 (32 for mxfp4), 0 otherwise

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


def row_block(w: QTensor, start: int, rows: int) -> QTensor:
    """Rows [start, start + rows) of a stored matrix, as a QTensor over the same memory (its data
    and scales rows: no copy). Dequantizes to exactly those rows of `w.dequantize()`."""
    if len(w.shape) != 2 or not 0 <= start <= start + rows <= w.shape[0] or rows < 1:
        raise ValueError(f"rows [{start}, {start + rows}) of a matrix of shape {w.shape}")
    scales = None if w.scales is None else w.scales[start:start + rows]
    return QTensor(w.dtype, (rows, w.shape[1]), w.data[start:start + rows], scales, w.group_size)


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
    if dtype == "mxfp4":
        return quantize_mxfp4(a)
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


def quantize_mxfp4(w: npt.ArrayLike) -> QTensor:
    """A float matrix [R, C] -> mxfp4 (OCP MX: shared exponent floor(log2(amax)) - 2 per 32
    values, each value rounded to the nearest e2m1, ties to even, clamped to +-6). Lossy, like
    any quantizer; an MXFP4 source is never re-quantized (the converter copies its bytes)."""
    a = np.asarray(w, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"mxfp4 quantization needs a 2-D matrix, got shape {a.shape}")
    rows, cols = a.shape
    cp = _padded(cols, MXFP4_GROUP)
    if cp != cols:
        a = np.pad(a, ((0, 0), (0, cp - cols)))
    g = a.reshape(rows, cp // MXFP4_GROUP, MXFP4_GROUP).astype(np.float64)  # [R, G, 32]
    amax = np.abs(g).max(axis=-1)  # [R, G]
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    e = np.clip(exp + 127, 0, 254).astype(np.uint8)  # [R, G]
    scaled = g / e8m0_to_f32(e).astype(np.float64)[..., None]
    mags = E2M1[:8].astype(np.float64)  # the grid, increasing
    m = np.minimum(np.abs(scaled), 6.0)
    idx = np.searchsorted(mags, m)  # first grid value >= m
    lo = np.clip(idx - 1, 0, 7)
    hi = np.clip(idx, 0, 7)
    dlo, dhi = m - mags[lo], mags[hi] - m
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))  # ties to the even code (0 mantissa bit)
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = code | np.where(np.signbit(scaled) & (code > 0), np.uint8(8), np.uint8(0)).astype(np.uint8)  # 0 is +0
    q = code.reshape(rows, cp)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # [R, Cp // 2]
    return QTensor("mxfp4", (rows, cols), packed, e, MXFP4_GROUP)


def mxfp4_tensor(blocks: npt.NDArray[np.uint8], scales: npt.NDArray[np.uint8], cols: int) -> QTensor:
    """An MXFP4 matrix as checkpoints store it (blocks uint8 [R, C/32, 16], scales uint8 [R, C/32])
    -> QTensor, the same bytes (lossless: nothing is decoded)."""
    rows = blocks.shape[0]
    g = -(-cols // MXFP4_GROUP)
    if blocks.shape != (rows, g, MXFP4_GROUP // 2) or scales.shape != (rows, g):
        raise ValueError(f"mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not hold a "
                         f"[{rows}, {cols}] matrix (want [{rows}, {g}, 16] and [{rows}, {g}])")
    data = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, g * MXFP4_GROUP // 2)
    return QTensor("mxfp4", (rows, cols), data, np.ascontiguousarray(scales, dtype=np.uint8), MXFP4_GROUP)


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
    if t.dtype == "mxfp4":
        codes = np.empty((t.data.shape[0], t.data.shape[1] * 2), dtype=np.uint8)
        codes[:, 0::2] = t.data & 0x0F
        codes[:, 1::2] = t.data >> 4
        vals = E2M1[codes].reshape(codes.shape[0], -1, MXFP4_GROUP)  # [R, G, 32]
        with np.errstate(over="ignore", invalid="ignore"):
            w = (vals * e8m0_to_f32(t.scales)[..., None]).reshape(codes.shape)
        return np.ascontiguousarray(w[:, : t.shape[1]])
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
    if dtype == "mxfp4":
        cp = _padded(cols, MXFP4_GROUP)
        return rows * cp // 2, rows * (cp // MXFP4_GROUP)
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
class ExpertAct:
    """An expert's gated activation. "silu": silu(g) * u. "clamped_swiglu" (gpt-oss):
    g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    kind: Literal["silu", "clamped_swiglu"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "alpha": self.alpha, "limit": self.limit}


SILU = ExpertAct()


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: SwiGLU FFN  y = down(act(gate x, up x)) (+ biases: gpt-oss)."""

    gate: QTensor  # [I, D]
    up: QTensor  # [I, D]
    down: QTensor  # [D, I]
    gate_bias: npt.NDArray[np.float32] | None = None  # [I]
    up_bias: npt.NDArray[np.float32] | None = None  # [I]
    down_bias: npt.NDArray[np.float32] | None = None  # [D]
    act: ExpertAct = SILU

    @property
    def nbytes(self) -> int:
        biases = sum(b.nbytes for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None)
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + biases
