"""numba fallback kernels: the arithmetic contract of the C kernels, operation for operation.

Used when the C extension was not built (no compiler at install time). They follow the
contract at the top of moetier/kernels/csrc/mt.h exactly -- sixteen lane accumulators
updated with a true fused multiply-add (llvm.fma), the fixed pairwise tree, zero-filled
tails -- so they produce the same bits as the C kernels, only slower.

Why this is invariant by construction: nothing here is compiled with fastmath, so LLVM
may not reassociate, contract or reorder floating-point operations; the source order IS
the evaluation order. Every reduction runs over the reduced dimension with bounds that
depend on that dimension alone; every other operation is elementwise. `prange` splits
output rows (linear) or (token, head) items (attention) between threads; an output
element is always computed whole by one thread with the same sequence of operations.

Weights arrive as raw bytes [R, row_bytes] plus a dtype code, so every kernel has a
single numba signature (one compile, cached on disk).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

DT_F32, DT_BF16, DT_INT8, DT_INT4, DT_MXFP4 = 0, 1, 2, 3, 4
MX_GROUP = 32
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)
LANES = 16
RB = 4  # output rows dequantized together (mirrors the C kernels; no effect on bits)

# 2**(e - 25) for float16 exponent e (and 2**-24 for subnormals): exact powers of two.
_P2 = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [0.0], dtype=np.float32)


def _fma_typer(typingctx: Any, a: Any, b: Any, c: Any) -> tuple[Any, Any]:
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


# Single-rounding fused multiply-add on float32 (llvm.fma.f32): vfmadd where the CPU has
# FMA, libm's correctly rounded fmaf elsewhere -- the same value either way.
_fma: Any = intrinsic(_fma_typer)


@njit(cache=True)
def _f16(h: int) -> np.float32:
    """float16 bits -> float32, exactly."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    elif e == 0:
        v = np.float32(m) * _P2[0]
    else:
        v = np.float32(m + 1024) * _P2[e]
    return -v if h & 0x8000 else v


# the contract's exponential (mt_exp in csrc/mt.h), constant for constant
_LOG2E = np.float32(1.44269504088896341)
_C1 = np.float32(0.693359375)
_C2 = np.float32(-2.12194440e-4)
_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                   1.6666665459e-1, 5.0000001201e-1))
_LO = np.float32(-86.5)
_HI = np.float32(88.75)


@njit(cache=True)
def _exp(x: np.float32) -> np.float32:
    if x != x:
        return x
    if x < _LO:
        return np.float32(0.0)
    if x > _HI:
        return np.float32(np.inf)
    n = np.float32(np.rint(x * _LOG2E))
    r = _fma(-n, _C1, x)
    r = _fma(-n, _C2, r)
    z = r * r
    y = _P[0]
    y = _fma(y, r, _P[1])
    y = _fma(y, r, _P[2])
    y = _fma(y, r, _P[3])
    y = _fma(y, r, _P[4])
    y = _fma(y, r, _P[5])
    y = _fma(y, z, r)
    y = y + np.float32(1.0)
    pw = np.float32(math.ldexp(1.0, int(n) - 1))  # 2^(n-1), exact
    return (y * pw) * np.float32(2.0)


@njit(cache=True)
def exp(x: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the contract's exp(x[i]) (tests compare it across backends)."""
    for i in range(x.size):
        out[i] = _exp(x[i] - np.float32(0.0))


@njit(cache=True)
def _hsum16(acc: np.ndarray) -> np.float32:
    s0 = acc[0] + acc[8]
    s1 = acc[1] + acc[9]
    s2 = acc[2] + acc[10]
    s3 = acc[3] + acc[11]
    s4 = acc[4] + acc[12]
    s5 = acc[5] + acc[13]
    s6 = acc[6] + acc[14]
    s7 = acc[7] + acc[15]
    t0 = s0 + s4
    t1 = s1 + s5
    t2 = s2 + s6
    t3 = s3 + s7
    u0 = t0 + t2
    u1 = t1 + t3
    return u0 + u1


@njit(cache=True)
def _dot(a: np.ndarray, b: np.ndarray, n: int, acc: np.ndarray) -> np.float32:
    """The dot contract over a[0:n], b[0:n]; acc is a scratch of 16 float32."""
    zero = np.float32(0.0)
    for lane in range(LANES):
        acc[lane] = zero
    nfull = n - n % LANES
    for k in range(0, nfull, LANES):
        for lane in range(LANES):
            acc[lane] = _fma(a[k + lane], b[k + lane], acc[lane])
    if nfull < n:
        for lane in range(LANES):
            c = nfull + lane
            if c < n:
                acc[lane] = _fma(a[c], b[c], acc[lane])
            else:
                acc[lane] = _fma(zero, zero, acc[lane])
    return _hsum16(acc)


@njit(cache=True)
def _sum(a: np.ndarray, n: int, acc: np.ndarray) -> np.float32:
    """The sum contract over a[0:n]."""
    zero = np.float32(0.0)
    for lane in range(LANES):
        acc[lane] = zero
    for k in range(0, n, LANES):
        for lane in range(LANES):
            c = k + lane
            acc[lane] = acc[lane] + (a[c] if c < n else zero)
    return _hsum16(acc)


@njit(cache=True)
def _e8m0(e: int) -> np.float32:
    """e8m0 byte -> 2^(e - 127) (0: the subnormal 2^-127; 255: NaN), exactly (csrc/mt.h mt_e8m0)."""
    bits = np.zeros(1, np.uint32)
    bits[0] = 0x00400000 if e == 0 else (0x7FC00000 if e == 255 else e << 23)
    return bits.view(np.float32)[0]


@njit(cache=True)
def _dequant_row(data: np.ndarray, scales: np.ndarray, dtype: int, g: int, r: int, cols: int,
                 out: np.ndarray, bits: np.ndarray) -> None:
    """Row r of a weight given as bytes -> out[0:cols], exactly the reference values
    (int4 writes whole groups: out[0:Cp]).

    bits: a uint32 scratch of >= cols entries (bf16 widening goes through it)."""
    row = data[r]
    if dtype == DT_F32:
        out[:cols] = row.view(np.float32)[:cols]
    elif dtype == DT_BF16:
        b16 = row.view(np.uint16)
        for c in range(cols):
            bits[c] = np.uint32(b16[c]) << np.uint32(16)
        out[:cols] = bits.view(np.float32)[:cols]
    elif dtype == DT_INT8:
        q8 = row.view(np.int8)
        for gi in range(scales.shape[1]):
            sc = _f16(int(scales[r, gi]))
            for c in range(gi * g, min(cols, (gi + 1) * g)):
                out[c] = np.float32(q8[c]) * sc
    elif dtype == DT_MXFP4:  # whole groups of 32 (scales: the e8m0 bytes, widened)
        for gi in range(scales.shape[1]):
            sc = _e8m0(int(scales[r, gi]))
            for j in range(gi * (MX_GROUP // 2), (gi + 1) * (MX_GROUP // 2)):
                b = int(row[j])
                out[2 * j] = _E2M1[b & 15] * sc
                out[2 * j + 1] = _E2M1[b >> 4] * sc
    else:  # int4: whole groups of whole bytes (g is even); out holds Cp >= C values
        half = g // 2
        for gi in range(scales.shape[1]):
            sc = _f16(int(scales[r, gi]))
            for j in range(gi * half, (gi + 1) * half):
                b = int(row[j])
                out[2 * j] = np.float32((b & 15) - 8) * sc
                out[2 * j + 1] = np.float32((b >> 4) - 8) * sc


@njit(cache=True, parallel=True)
def linear(x: np.ndarray, data: np.ndarray, scales: np.ndarray, dtype: int, g: int, cols: int,
           bias: np.ndarray, has_bias: bool, out: np.ndarray) -> None:
    """out[t, r] = dot(x[t], w[r], C) (+ bias[r]); x [T, C], out [T, R]."""
    T = x.shape[0]
    R = out.shape[1]
    nb = (R + RB - 1) // RB
    for b in prange(nb):
        buf = np.empty(max(cols, scales.shape[1] * g) + LANES, np.float32)
        bits = np.empty(cols + LANES, np.uint32)
        acc = np.empty(LANES, np.float32)
        for r in range(b * RB, min(R, (b + 1) * RB)):
            _dequant_row(data, scales, dtype, g, r, cols, buf, bits)
            for t in range(T):
                y = _dot(buf, x[t], cols, acc)
                out[t, r] = y + bias[r] if has_bias else y


@njit(cache=True)
def swiglu(hg: np.ndarray, hu: np.ndarray) -> None:
    """hg <- silu(hg) * hu, written as the reference writes it: (g / (1 + exp(-g))) * u."""
    flat_g = hg.reshape(-1)
    flat_u = hu.reshape(-1)
    one = np.float32(1.0)
    for i in range(flat_g.size):
        gv = flat_g[i]
        sl = gv / (one + _exp(np.float32(0.0) - gv))
        flat_g[i] = sl * flat_u[i]


@njit(cache=True)
def glu_clamped(hg: np.ndarray, hu: np.ndarray, alpha: np.float32, limit: np.float32) -> None:
    """hg <- gpt-oss's clamped SwiGLU of (hg, hu), exactly csrc/ops.c mt_glu_clamped."""
    flat_g = hg.reshape(-1)
    flat_u = hu.reshape(-1)
    one = np.float32(1.0)
    for i in range(flat_g.size):
        gv = limit if flat_g[i] > limit else flat_g[i]
        u = flat_u[i]
        uv = limit if u > limit else (-limit if u < -limit else u)
        sg = one / (one + _exp(np.float32(0.0) - gv * alpha))
        flat_g[i] = (uv + one) * (gv * sg)


@njit(cache=True)
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    T, C = x.shape
    acc = np.empty(LANES, np.float32)
    for t in range(T):
        var = _dot(x[t], x[t], C, acc) / np.float32(C)
        den = math.sqrt(var + eps)
        for c in range(C):
            out[t, c] = x[t, c] / den * weight[c]


@njit(cache=True)
def _softmax_row(x: np.ndarray, n: int, y: np.ndarray, acc: np.ndarray) -> None:
    m = np.float32(-np.inf)
    for i in range(n):
        m = x[i] if x[i] > m else m
    for i in range(n):
        y[i] = _exp(x[i] - m)
    s = _sum(y, n, acc)
    for i in range(n):
        y[i] = y[i] / s


@njit(cache=True)
def softmax(x: np.ndarray, out: np.ndarray) -> None:
    acc = np.empty(LANES, np.float32)
    for t in range(x.shape[0]):
        _softmax_row(x[t], x.shape[1], out[t], acc)


@njit(cache=True, parallel=True)
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: np.float32,
              out: np.ndarray, sinks: np.ndarray, has_sinks: bool, window: int) -> None:
    """q [T, H, dq], k [S, Hkv, dq], v [S, Hkv, dv] -> out [T, H, dv]; row t sees keys
    lo..q_pos[t] (lo = 0, or q_pos[t] - window + 1 under a sliding window), with a learned sink
    per head in the softmax's denominator when has_sinks (csrc/mt.h)."""
    T, H, dq = q.shape
    Hkv, dv = v.shape[1], v.shape[2]
    rep = H // Hkv
    for item in prange(T * H):
        t = item // H
        h = item % H
        kvh = h // rep
        n = q_pos[t] + 1
        lo = q_pos[t] - window + 1 if window > 0 and q_pos[t] - window + 1 > 0 else 0
        acc = np.empty(LANES, np.float32)
        p = np.empty(n - lo, np.float32)
        for s in range(lo, n):
            p[s - lo] = _dot(q[t, h], k[s, kvh], dq, acc) * scale
        if has_sinks:
            sink = sinks[h]
            m = sink
            for i in range(n - lo):
                m = p[i] if p[i] > m else m
            for i in range(n - lo):
                p[i] = _exp(p[i] - m)
            den = _sum(p, n - lo, acc) + _exp(sink - m)
            for i in range(n - lo):
                p[i] = p[i] / den
        else:
            _softmax_row(p, n - lo, p, acc)
        o = out[t, h]
        for d in range(dv):
            o[d] = np.float32(0.0)
        for s in range(lo, n):
            ps = p[s - lo]
            vr = v[s, kvh]
            for d in range(dv):
                o[d] = _fma(ps, vr[d], o[d])
