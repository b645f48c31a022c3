"""FastOps against ReferenceOps (accuracy), against itself (bit-exact row invariance) and
across its backends (every C path this CPU runs -- AVX-512, AVX2, NEON, portable -- and
numba: the same bits)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from moetier.kernels import (
    FastOps,
    c_available,
    c_paths,
    c_problem,
    fast,
    idle_spin_us,
    park_helpers,
    set_idle_spin,
    warmup,
)
from moetier.kernels.fast import Backend
from moetier.model.ops import ReferenceOps, combine_slots, head_linears
from moetier.model.router import routing_weights
from moetier.weights.quant import (
    ExpertAct,
    ExpertWeights,
    QDType,
    QTensor,
    mxfp4_tensor,
    quantize,
    relative_rms_error,
)

BACKENDS = [name for name, runs in c_paths().items() if runs] + ["numba"]
REF = ReferenceOps()
DTYPES = ("f32", "bf16", "int8", "int4", "mxfp4")


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request: pytest.FixtureRequest) -> FastOps:
    return FastOps(request.param, threads=2)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def close(ref: np.ndarray, got: np.ndarray, rtol: float = 1e-5) -> None:
    """Agreement relative to the output's scale (summation order differs from BLAS)."""
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - ref).max())
    assert err <= rtol * scale, f"max error {err:.3g} vs output scale {scale:.3g}"


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,cols,g",
    [(1, 1, 2), (3, 5, 4), (37, 100, 64), (8, 130, 32), (16, 96, 48), (5, 64, 6), (64, 256, 64), (9, 2048, 64)],
)
def test_linear_matches_reference(ops: FastOps, dtype: str, rows: int, cols: int, g: int) -> None:
    rng = np.random.default_rng(rows * 1000 + cols)
    w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
    bias = rand(rng, rows)
    for t in (1, 3, 7):
        x = rand(rng, t, cols)
        close(REF.linear(x, w), ops.linear(x, w))
        close(REF.linear(x, w, bias), ops.linear(x, w, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_linears_give_the_bits_of_linear_on_each_heads_rows(ops: FastOps, dtype: str) -> None:
    """MLA's absorption reads the stored kv_b rows per head, transposed (the rows are inputs)
    or not: the bits of `linear` on each head's rows (transposed: as float32), exact in either
    activation setting, on both sides of the transposed kernel's row limit, other output
    columns untouched; the reference ops agree to rounding."""
    rng = np.random.default_rng(11)
    heads, n, dv, c = 3, 40, 24, 100  # n: not a multiple of 16; c: not a multiple of 64
    w = quantize(rand(rng, heads * (n + dv), c) * 0.05, dtype, 32 if dtype == "mxfp4" else 16)
    exact = FastOps(ops.backend, threads=2)
    variants = [ops] + ([FastOps(ops.backend, threads=2, activations="int8")] if ops.backend != "numba" else [])
    for t in (1, 4, 5, 17, fast.LINEAR_T_MAX_ROWS + 1):
        x = rand(rng, t, heads, n + 7)
        xc = rand(rng, t, heads, c)
        want_t = np.empty((t, heads, c), dtype=np.float32)
        want = np.empty((t, heads, dv), dtype=np.float32)
        for h in range(heads):
            rows = w.dequantize()[h * (n + dv):(h + 1) * (n + dv)]
            want_t[:, h] = exact.linear(np.ascontiguousarray(x[:, h, :n]), quantize(np.ascontiguousarray(rows[:n].T), "f32"))
            want[:, h] = exact.linear(np.ascontiguousarray(xc[:, h]), quantize(rows[n:], "f32"))
        for o in variants:
            out = np.full((t, heads, c + 3), 7.0, dtype=np.float32)
            assert head_linears(o, x, w, n + dv, 0, n, transposed=True, out=out) is out
            assert same_bits(out[:, :, :c], want_t) and (out[:, :, c:] == 7.0).all(), (o, t)
            assert same_bits(head_linears(o, xc, w, n + dv, n, dv, transposed=False), want), (o, t)
        close(want_t, head_linears(REF, x, w, n + dv, 0, n, transposed=True))
        close(want, head_linears(REF, xc, w, n + dv, n, dv, transposed=False))
    # more heads than one job of the kernels takes (64), columns in multiples of 16 (the SIMD
    # paths' own int4 order), x wider than the rows and out wider than a head's output
    heads, n, dv, c = 66, 16, 24, 128
    w = quantize(rand(rng, heads * (n + dv), c) * 0.05, dtype, 32)
    deq = w.dequantize()
    for t in (1, 13):
        xc = rand(rng, t, heads, c + 5)
        want = np.stack([exact.linear(np.ascontiguousarray(xc[:, h, :c]),
                                      quantize(deq[h * (n + dv) + n:(h + 1) * (n + dv)], "f32"))
                         for h in range(heads)], axis=1)
        for o in variants:
            out = np.full((t, heads, dv + 2), 7.0, dtype=np.float32)
            head_linears(o, xc, w, n + dv, n, dv, transposed=False, out=out)
            assert same_bits(out[:, :, :dv], want) and (out[:, :, dv:] == 7.0).all(), (o, t)
    with pytest.raises(ValueError, match="heads of"):
        ops.head_linears(rand(rng, 1, heads, n), w, n + dv, dv + 1, n, transposed=True)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_per_head_kernels_refuse_shapes_and_strides_that_do_not_fit() -> None:
    """The C entry points check what FastOps checks: blocks inside w, strides that keep heads
    apart, buffers as large as the strides say."""
    from moetier.kernels import _ckernels

    rng = np.random.default_rng(3)
    w = quantize(rand(rng, 2 * 24, 64), "int8", 32)
    spec = fast._spec(w, "w")[2]
    isa = next(i for i, (_, ok) in enumerate(_ckernels.isas()) if ok)
    x, out = rand(rng, 1, 2, 64), np.zeros((1, 2, 64), dtype=np.float32)
    _ckernels.head_linears(x, 128, 64, 1, 2, 16, spec, 48, 64, 24, 8, out, 128, 64, isa, 1)  # fits
    want = w.dequantize()[8:24] @ x[0, 0]
    close(out[0, 0, :16], want)
    for bad in ((x, 128, 64, 1, 2, 16, spec, 48, 64, 24, 9, out, 128, 64, isa, 1),  # rows past w
                (x, 128, 32, 1, 2, 16, spec, 48, 64, 24, 8, out, 128, 64, isa, 1),  # heads overlap in x
                (x, 128, 64, 1, 2, 16, spec, 48, 64, 24, 8, out, 128, 8, isa, 1)):  # ... in out
        with pytest.raises(ValueError, match="head_linears: inconsistent"):
            _ckernels.head_linears(*bad)
    with pytest.raises(ValueError, match="x"):  # a buffer shorter than its strides
        _ckernels.head_linears(x[:, :1], 128, 64, 1, 2, 16, spec, 48, 64, 24, 8, out, 128, 64, isa, 1)
    with pytest.raises(ValueError, match="linear_t: inconsistent"):
        _ckernels.linear_t(x, 128, 64, 1, 2, 16, spec, 48, 64, 24, 9, out, 128, 64, 1)


def test_rmsnorm_softmax_match_reference(ops: FastOps) -> None:
    rng = np.random.default_rng(1)
    for t, c in ((1, 1), (3, 17), (5, 2048)):
        x = rand(rng, t, c) * 3
        w = rand(rng, c)
        close(REF.rmsnorm(x, w, 1e-6), ops.rmsnorm(x, w, 1e-6))
        close(REF.softmax(x), ops.softmax(x))
    logits = np.array([[0.0, -np.inf, 1.0], [5.0, 5.0, 5.0]], dtype=np.float32)
    close(REF.softmax(logits), ops.softmax(logits))


@pytest.mark.parametrize("h,hkv,dq,dv", [(4, 4, 16, 16), (8, 2, 40, 24), (6, 1, 72, 64), (3, 1, 5, 3)])
def test_attention_matches_reference(ops: FastOps, h: int, hkv: int, dq: int, dv: int) -> None:
    rng = np.random.default_rng(h * dq)
    s = 23
    q, k, v = rand(rng, 7, h, dq), rand(rng, s, hkv, dq), rand(rng, s, hkv, dv)
    pos = np.array([0, 22, 5, 6, 7, 13, 22])
    close(REF.attention(q, k, v, pos, 0.3), ops.attention(q, k, v, pos, 0.3))


def experts_of(rng: np.random.Generator, n: int, d: int, i: int, dtype: str, g: int) -> dict[int, ExpertWeights]:
    def q(r: int, c: int) -> QTensor:
        return quantize(rand(rng, r, c) * 0.3, dtype, g)  # type: ignore[arg-type]

    return {e: ExpertWeights(q(i, d), q(i, d), q(d, i)) for e in range(n)}


@pytest.mark.parametrize("dtype,g", [("int4", 64), ("int4", 32), ("int8", 64), ("bf16", 0), ("f32", 0), ("int4", 10)])
def test_moe_matches_reference(ops: FastOps, dtype: str, g: int) -> None:
    rng = np.random.default_rng(7)
    d, i = 72, 40
    ex = experts_of(rng, 5, d, i, dtype, g or 64)
    x = rand(rng, 9, d)
    for k in (1, 3):
        ids = rng.integers(0, 5, (9, k)).astype(np.int32)
        wts = rng.random((9, k), dtype=np.float32)
        close(REF.moe(x, ids, wts, ex), ops.moe(x, ids, wts, ex))
    # one expert used by every row (K = 1), and experts used by a single row
    ids = np.zeros((9, 1), dtype=np.int32)
    close(REF.moe(x, ids, np.ones((9, 1), np.float32), ex), ops.moe(x, ids, np.ones((9, 1), np.float32), ex))
    ids = np.arange(9, dtype=np.int32).reshape(9, 1) % 5
    close(REF.moe(x, ids, np.ones((9, 1), np.float32), ex), ops.moe(x, ids, np.ones((9, 1), np.float32), ex))


def test_int4_dequantized_values_are_the_reference_values(ops: FastOps) -> None:
    """Against an identity input each output is one dequantized weight, exactly."""
    rng = np.random.default_rng(3)
    for dtype in DTYPES:
        w = quantize(rand(rng, 6, 50), dtype, 16)  # type: ignore[arg-type]
        eye = np.eye(50, dtype=np.float32)
        assert same_bits(ops.linear(eye, w), w.dequantize().T.copy())


# ---------------------------------------------------------------- bit-exact row invariance


def test_linear_rows_are_invariant(ops: FastOps) -> None:
    """Row t's bits do not depend on T, on its position, or on its companions."""
    rng = np.random.default_rng(11)
    for case in range(12):
        dtype = DTYPES[case % 4]
        rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 300))
        g = int(rng.choice([16, 32, 64, 6]))
        w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
        bias = rand(rng, rows) if case % 2 else None
        x = rand(rng, 17, cols)
        full = ops.linear(x, w, bias)
        for t in range(17):  # alone (T = 1)
            assert same_bits(ops.linear(x[t : t + 1], w, bias), full[t : t + 1]), (dtype, rows, cols, g, t)
        for n in range(1, 18):  # every T, shuffled, with fresh companions
            pick = rng.permutation(17)[:n]
            others = rand(rng, int(rng.integers(0, 5)), cols)
            xb = np.concatenate([others, x[pick]])
            got = ops.linear(xb, w, bias)[len(others) :]
            assert same_bits(got, full[pick]), (dtype, rows, cols, g, n)


def test_rmsnorm_softmax_rows_are_invariant(ops: FastOps) -> None:
    rng = np.random.default_rng(12)
    for c in (1, 15, 16, 17, 300):
        x = rand(rng, 17, c)
        w = rand(rng, c)
        full_n, full_s = ops.rmsnorm(x, w, 1e-5), ops.softmax(x)
        for n in (1, 2, 5, 16, 17):
            pick = rng.permutation(17)[:n]
            assert same_bits(ops.rmsnorm(x[pick], w, 1e-5), full_n[pick])
            assert same_bits(ops.softmax(x[pick]), full_s[pick])


@pytest.mark.parametrize("h,hkv,dq,dv", [(4, 4, 16, 16), (8, 2, 40, 24), (6, 1, 72, 64), (16, 1, 33, 17)])
def test_attention_chunked_prefill_and_decode_give_the_same_bits(ops: FastOps, h: int, hkv: int, dq: int,
                                                                   dv: int) -> None:
    rng = np.random.default_rng(h + dq)
    s = 17
    q, k, v = rand(rng, s, h, dq), rand(rng, s, hkv, dq), rand(rng, s, hkv, dv)
    pos = np.arange(s)
    full = ops.attention(q, k, v, pos, 0.2)  # prefill of all 17 rows at once
    for chunk in (1, 2, 3, 5, 16):  # chunked prefill, chunk 1 = decode one row at a time
        parts = []
        for a in range(0, s, chunk):
            b = min(s, a + chunk)
            # the cache holds only what has been written so far
            parts.append(ops.attention(q[a:b], k[:b], v[:b], pos[a:b], 0.2))
        assert same_bits(np.concatenate(parts), full), chunk
    # a row depends only on the keys it sees: change everything after its position
    for t in (0, 4, 16):
        k2, v2 = k.copy(), v.copy()
        k2[t + 1 :] = rand(rng, s - t - 1, hkv, dq)
        v2[t + 1 :] = rand(rng, s - t - 1, hkv, dv)
        sel = np.array([t])
        assert same_bits(ops.attention(q[sel], k2, v2, pos[sel], 0.2), full[sel])
    # and not on the other query rows, nor on their order
    perm = rng.permutation(s)
    assert same_bits(ops.attention(q[perm], k, v, pos[perm], 0.2), full[perm])


def test_moe_rows_do_not_depend_on_companions(ops: FastOps) -> None:
    rng = np.random.default_rng(21)
    d, i, ne = 96, 48, 6
    ex = experts_of(rng, ne, d, i, "int4", 32)
    for k in (1, 2, 4):
        t = 17
        x = rand(rng, t, d)
        ids = np.stack([rng.permutation(ne)[:k] for _ in range(t)]).astype(np.int32)
        wts = rng.random((t, k), dtype=np.float32)
        full = ops.moe(x, ids, wts, ex)
        for r in range(t):  # alone: its experts serve it and nobody else
            assert same_bits(ops.moe(x[r : r + 1], ids[r : r + 1], wts[r : r + 1], ex), full[r : r + 1])
        for n in (2, 5, 9, 16):  # other companions, other positions, experts shared differently
            pick = rng.permutation(t)[:n]
            others = rand(rng, 3, d)
            oid = np.full((3, k), ids[pick[0], 0], dtype=np.int32)
            oid[:, 1:] = ids[pick[0], 1:]
            xb = np.concatenate([x[pick], others])
            got = ops.moe(xb, np.concatenate([ids[pick], oid]), np.concatenate([wts[pick], wts[:3]]), ex)
            assert same_bits(got[:n], full[pick]), (k, n)


def test_moe_in_waves_of_experts_gives_the_same_bits(ops: FastOps) -> None:
    """`moe` is exactly `expert_outputs` over every routed expert, then `combine_slots`: the
    experts given in any waves (any partition, any order) fill the [T, K, D] slots with the
    same bits, and the combine of those slots is `moe`'s result. So is the reference's."""
    rng = np.random.default_rng(23)
    d, i, ne = 80, 40, 7
    ex = experts_of(rng, ne, d, i, "int4", 16)
    for t, k in ((1, 3), (13, 2), (21, 5)):
        x = rand(rng, t, d)
        ids = np.stack([rng.permutation(ne)[:k] for _ in range(t)]).astype(np.int32)
        ids[0, -1] = ids[0, 0]  # a duplicate id in a row
        wts = rng.random((t, k), dtype=np.float32)
        for o in (ops, REF):
            full = o.moe(x, ids, wts, ex)
            for size in (1, 2, 3):
                order = rng.permutation(ne).tolist()
                slots = np.full((t, k, d), np.nan, dtype=np.float32)
                for a in range(0, ne, size):
                    o.expert_outputs(x, ids, {e: ex[e] for e in order[a : a + size]}, slots)
                assert not np.isnan(slots).any()
                assert same_bits(combine_slots(slots, wts), full), (t, k, size)
    # slots of experts not given are left as they are
    slots = np.full((t, k, d), 7.0, dtype=np.float32)
    ops.expert_outputs(x, ids, {int(ids[0, 0]): ex[int(ids[0, 0])]}, slots)
    routed = ids == ids[0, 0]
    assert (slots[~routed] == 7.0).all() and not (slots[routed] == 7.0).all()
    with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous float32 \(21, 5, 80\)"):
        ops.expert_outputs(x, ids, ex, np.zeros((t, k, d), np.float64))
    with pytest.raises(ValueError, match=r"out must be"):
        ops.expert_outputs(x, ids, ex, np.zeros((t, d, k), np.float32).transpose(0, 2, 1))


def test_experts_computed_together_give_each_experts_own_bits(ops: FastOps) -> None:
    """A layer's experts go to the kernels together (one job for every gate and up, one for
    every down, in groups of 32): each slot holds the bits of its expert run alone on its
    row -- with more experts than a group, one expert with enough rows for the batched path,
    a duplicate id in a row, an unrouted slot (-1), an expert not given, and a biased expert
    (computed apart) among them."""
    rng = np.random.default_rng(27)
    d, i, ne, t, k = 64, 96, 40, 48, 4
    ex = experts_of(rng, ne, d, i, "int4", 32)
    act = ExpertAct("clamped_swiglu", 1.702, 7.0)
    ex[5] = ExpertWeights(ex[5].gate, ex[5].up, ex[5].down, rand(rng, i), rand(rng, i), rand(rng, d), act)
    x = rand(rng, t, d)
    ids = rng.integers(0, ne, (t, k)).astype(np.int32)
    ids[:40, 0] = 7  # 40 rows on one expert
    ids[3, 2] = ids[3, 1]  # a duplicate in a row
    ids[4, 3] = -1  # unrouted
    given = {e: w for e, w in ex.items() if e != 11}
    out = np.full((t, k, d), 7.5, dtype=np.float32)
    ops.expert_outputs(x, ids, given, out)
    for r in range(t):
        for j in range(k):
            e = int(ids[r, j])
            if e in given:
                assert same_bits(out[r, j], ops.expert_ffn(x[r : r + 1], given[e])[0]), (r, j, e)
            else:
                assert (out[r, j] == 7.5).all(), (r, j, e)


# ---------------------------------------------------------------- backends agree bit for bit


@pytest.mark.skipif(len(BACKENDS) < 2, reason="the C extension is not built")
def test_backends_give_identical_bits() -> None:
    rng = np.random.default_rng(5)
    all_ops = [FastOps(b, threads=2) for b in BACKENDS]
    cases = []
    for dtype in DTYPES:
        for rows, cols, g in ((13, 77, 32), (8, 64, 64), (5, 30, 10)):
            w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
            for t in (1, 3, 6):
                cases.append(("linear", (rand(rng, t, cols), w, rand(rng, rows))))
    x = rand(rng, 6, 45)
    cases += [("rmsnorm", (x, rand(rng, 45), 1e-6)), ("softmax", (x,))]
    q, k, v = rand(rng, 5, 6, 40), rand(rng, 9, 2, 40), rand(rng, 9, 2, 20)
    cases.append(("attention", (q, k, v, np.array([0, 8, 3, 4, 8]), 0.5)))
    ex = experts_of(rng, 4, 48, 24, "int4", 16)
    ids = rng.integers(0, 4, (7, 2)).astype(np.int32)
    cases.append(("moe", (rand(rng, 7, 48), ids, rng.random((7, 2), dtype=np.float32), ex)))
    for name, args in cases:
        outs = [getattr(o, name)(*args) for o in all_ops]
        for o, got in zip(all_ops[1:], outs[1:], strict=True):
            assert same_bits(got, outs[0]), (name, o.backend)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
@pytest.mark.parametrize("path", [b for b in BACKENDS if b not in ("c-portable", "numba")] or ["none"])
def test_every_simd_path_gives_the_portable_bits(path: str) -> None:
    """Each SIMD path against the portable C path, bit for bit, on the shapes where the
    paths differ most: every token count of the fused decode kernels (1-4) and of the
    batched ones (5-13, 17, 31: the most that AVX2's few-token kernels take, in tiles of
    three and two tokens; 100: more than the 96 tokens whose accumulators a batched kernel
    keeps at once), chunk tails (columns not a multiple of 16), groups that do
    and do not split a chunk of 16, every dtype, bias or none; attention with head counts
    and widths that leave partial tiles; softmax and rmsnorm lengths around 8 and 16."""
    if path == "none":
        pytest.skip("this CPU runs no SIMD path of the C kernels")
    rng = np.random.default_rng(31)
    simd, portable = FastOps(path, threads=2), FastOps("c-portable", threads=2)  # type: ignore[arg-type]
    for dtype in DTYPES:
        for rows, cols, g in ((1, 16, 16), (5, 33, 32), (9, 64, 64), (7, 100, 64), (13, 130, 32), (4, 47, 10),
                              (6, 96, 48), (11, 200, 6), (3, 8, 8), (17, 2048, 64), (8, 96, 32), (12, 384, 128),
                              (8, 1408, 64), (4, 2048, 256), (6, 544, 32), (8, 32, 64), (4, 96, 64),
                              (16, 1024, 16), (8, 2048, 1024)):
            w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
            bias = rand(rng, rows) if rows % 2 else None
            for t in (*range(1, 14), 17, 31, 100):
                x = rand(rng, t, cols)
                assert same_bits(simd.linear(x, w, bias), portable.linear(x, w, bias)), (dtype, rows, cols, g, t)
    for h, hkv, dq, dv, s in ((1, 1, 5, 3, 4), (4, 4, 16, 16, 9), (6, 2, 40, 24, 23), (16, 1, 72, 64, 40),
                              (3, 3, 33, 130, 17), (8, 1, 576, 512, 5)):
        for t in (1, 2, 5):
            q, k, v = rand(rng, t, h, dq), rand(rng, s, hkv, dq), rand(rng, s, hkv, dv)
            pos = rng.integers(0, s, t)
            assert same_bits(simd.attention(q, k, v, pos, 0.3), portable.attention(q, k, v, pos, 0.3)), (h, dq, dv)
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 100, 2048):
        x = rand(rng, 3, n) * 20
        wt = rand(rng, n)
        assert same_bits(simd.softmax(x), portable.softmax(x)), n
        assert same_bits(simd.rmsnorm(x, wt, 1e-6), portable.rmsnorm(x, wt, 1e-6)), n
    for dtype, g in (("int4", 64), ("int4", 10), ("int8", 32), ("bf16", 0)):
        ex = experts_of(rng, 3, 72, 40, dtype, g or 64)
        for t in (1, 2, 4, 5, 9):
            x = rand(rng, t, 72)
            ids = rng.integers(0, 3, (t, 2)).astype(np.int32)
            wts = rng.random((t, 2), dtype=np.float32)
            assert same_bits(simd.moe(x, ids, wts, ex), portable.moe(x, ids, wts, ex)), (dtype, t)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
@pytest.mark.parametrize("path", [b for b in BACKENDS if b not in ("c-portable", "numba")] or ["none"])
def test_decode_rows_in_lanes_give_the_portable_bits(path: str) -> None:
    """One to four tokens over enough rows that a job's chunks span many blocks, so the
    decode kernels take their rows in lanes (each a contiguous stretch of rows, mt_lanes):
    rows that fill whole lanes and rows that leave a rest of blocks or a partial last block,
    one to three threads (other chunk splits), every dtype, bias or none; and an expert's
    FFN of that size. Every row must come out with its own bits, in its own place."""
    if path == "none":
        pytest.skip("this CPU runs no SIMD path of the C kernels")
    rng = np.random.default_rng(43)
    portable = FastOps("c-portable", threads=1)
    for threads in (1, 2, 3):
        simd = FastOps(path, threads=threads)  # type: ignore[arg-type]
        for dtype in DTYPES:
            for rows, cols, g in ((64, 256, 64), (200, 512, 32), (258, 1408, 64), (1030, 96, 16)):
                w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
                bias = rand(rng, rows) if rows % 4 else None
                for t in (1, 2, 3, 4):
                    x = rand(rng, t, cols)
                    got, want = simd.linear(x, w, bias), portable.linear(x, w, bias)
                    assert same_bits(got, want), (threads, dtype, rows, cols, g, t)
    ex = experts_of(rng, 1, 512, 1408, "int4", 64)[0]
    for t in (1, 3):
        x = rand(rng, t, 512)
        assert same_bits(FastOps(path, threads=2).expert_ffn(x, ex), portable.expert_ffn(x, ex))  # type: ignore[arg-type]


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
@pytest.mark.parametrize("path", [b for b in BACKENDS if b not in ("c-portable", "numba")] or ["none"])
def test_quantized_weights_with_extreme_scales_give_the_portable_bits(path: str) -> None:
    """Group scales anywhere in float16 -- subnormal, the smallest and largest normal, zero,
    negative, infinite -- against the portable path on every token count of the int4 and
    int8 kernels: a path that forms a value another exact way (int4's high nibble as
    16 * nibble times scale / 16) must round exactly as the contract's fma(nibble, scale,
    -8 * scale) there too."""
    if path == "none":
        pytest.skip("this CPU runs no SIMD path of the C kernels")
    rng = np.random.default_rng(37)
    simd, portable = FastOps(path, threads=2), FastOps("c-portable", threads=2)  # type: ignore[arg-type]
    finite = np.array([0x0001, 0x03FF, 0x0400, 0x7BFF, 0x0000, 0x8001, 0xFBFF, 0x3C00, 0xB555], dtype=np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype in ("int4", "int8"):
            for rows, cols, g in ((12, 2048, 64), (16, 1024, 32), (10, 544, 32)):
                w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
                assert w.scales is not None
                bits = w.scales.view(np.uint16)
                # each row's groups of one magnitude (so an error at a tiny scale is not lost
                # beside a huge one in the sum), row 0 mixed, with one infinite scale
                bits[:] = finite[np.arange(rows) % finite.size][:, None] ^ rng.integers(0, 2, bits.shape, dtype=np.uint16)
                bits[0] = finite[rng.integers(0, finite.size, bits.shape[1])]
                bits[0, 1] = 0x7C00
                for t in (1, 2, 3, 4, 5, 6, 7, 13, 17, 40):
                    x = rand(rng, t, cols)
                    assert same_bits(simd.linear(x, w), portable.linear(x, w)), (dtype, rows, cols, g, t)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_int8_activations_same_bits_on_every_path_and_close_to_exact() -> None:
    """The int8-activation contract (lossy, opt-in): every C path gives the portable path's
    bits; the result stays within a few per cent of the exact kernels on random data
    (activations rounded to int8 per block of 64: about 0.4% error per value, averaging
    down over a row); weights outside the contract (bf16, groups not a multiple of 64)
    run the exact kernels."""
    rng = np.random.default_rng(41)
    paths = [b for b in BACKENDS if b != "numba"]
    exact = FastOps("c-portable", threads=2)
    for dtype, g in (("int4", 64), ("int4", 128), ("int8", 64), ("int8", 128)):
        for rows, cols in ((9, 64), (13, 100), (17, 2048), (8, 33)):
            w = quantize(rand(rng, rows, cols), dtype, g)  # type: ignore[arg-type]
            bias = rand(rng, rows)
            for t in (1, 2, 4, 5, 9, 17):
                x = rand(rng, t, cols)
                outs = [FastOps(p, threads=2, activations="int8").linear(x, w, bias) for p in paths]  # type: ignore[arg-type]
                assert all(same_bits(o, outs[0]) for o in outs[1:]), (dtype, g, rows, cols, t)
                want = exact.linear(x, w, bias)
                assert not same_bits(outs[0], want)  # it is another computation
                close(want, outs[0], rtol=0.03)
    for g in (10, 32):  # g % 64 != 0: exact
        w = quantize(rand(rng, 5, 100), "int4", g)
        x = rand(rng, 3, 100)
        assert same_bits(FastOps("c", activations="int8").linear(x, w), exact.linear(x, w))
    ex = experts_of(rng, 3, 128, 64, "int4", 64)
    x = rand(rng, 6, 128)
    ids = rng.integers(0, 3, (6, 2)).astype(np.int32)
    wts = rng.random((6, 2), dtype=np.float32)
    outs = [FastOps(p, threads=2, activations="int8").moe(x, ids, wts, ex) for p in paths]  # type: ignore[arg-type]
    assert all(same_bits(o, outs[0]) for o in outs[1:])
    close(exact.moe(x, ids, wts, ex), outs[0], rtol=0.05)
    with pytest.raises(ValueError, match="numba backend computes exact only"):
        FastOps("numba", activations="int8")
    with pytest.raises(ValueError, match="unknown activations"):
        FastOps("c", activations="fp8")  # type: ignore[arg-type]


def test_forcing_a_path_by_name() -> None:
    """A path is chosen by name; one this build or CPU lacks is a clear error naming what exists."""
    from moetier.kernels import c_best, set_default_backend

    assert FastOps("numba").backend == "numba"
    if not c_available():
        with pytest.raises(ValueError, match="not built"):
            FastOps("c-portable")
        return
    assert FastOps("c").backend == c_best() and FastOps("c-portable").backend == "c-portable"
    lacking = [b for b, runs in c_paths().items() if not runs]
    for b in lacking:
        with pytest.raises(ValueError, match="this CPU lacks its instructions"):
            FastOps(b)  # type: ignore[arg-type]
    absent = [b for b in ("c-avx2", "c-avx512", "c-neon") if b not in c_paths()]
    for b in absent:
        with pytest.raises(ValueError, match="not in this build"):
            FastOps(b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kernel backend 'c-sse'"):
        set_default_backend("c-sse")  # type: ignore[arg-type]
    try:
        set_default_backend("c-portable")
        assert FastOps().backend == "c-portable"
    finally:
        set_default_backend("auto")
    assert FastOps().backend == c_best()


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_value_error_naming_shapes() -> None:
    ops = FastOps()
    rng = np.random.default_rng(0)
    w = quantize(rand(rng, 4, 10), "int4", 8)
    with pytest.raises(ValueError, match=r"x \(2, 9\).*w \(4, 10\)"):
        ops.linear(rand(rng, 2, 9), w)
    with pytest.raises(ValueError, match=r"bias \(3,\)"):
        ops.linear(rand(rng, 2, 10), w, rand(rng, 3))
    with pytest.raises(ValueError, match="float32"):
        ops.linear(np.zeros((2, 10)), w)
    bad = QTensor("int4", (4, 10), w.data[:, :3], w.scales, 8)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        ops.linear(rand(rng, 2, 10), bad)
    bad = QTensor("int8", (4, 10), np.zeros((4, 16), np.int8), np.zeros((4, 1), np.float16), 8)
    with pytest.raises(ValueError, match="scales"):
        ops.linear(rand(rng, 2, 10), bad)
    with pytest.raises(ValueError, match=r"weight \(5,\)"):
        ops.rmsnorm(rand(rng, 2, 4), rand(rng, 5), 1e-6)
    q, k, v = rand(rng, 2, 4, 8), rand(rng, 5, 2, 8), rand(rng, 5, 2, 6)
    with pytest.raises(ValueError, match=r"k \(5, 2, 7\)"):
        ops.attention(q, rand(rng, 5, 2, 7), v, np.array([0, 1]), 1.0)
    with pytest.raises(ValueError, match="multiple"):
        ops.attention(rand(rng, 2, 3, 8), k, v, np.array([0, 1]), 1.0)
    with pytest.raises(ValueError, match="q_pos"):
        ops.attention(q, k, v, np.array([0, 5]), 1.0)
    with pytest.raises(ValueError, match="q_pos"):
        ops.attention(q, k, v, np.array([0, 1, 2]), 1.0)
    ex = experts_of(rng, 2, 16, 8, "int4", 8)
    x = rand(rng, 3, 16)
    with pytest.raises(ValueError, match=r"ids \(3, 2\), weights \(3, 1\)"):
        ops.moe(x, np.zeros((3, 2), np.int32), np.ones((3, 1), np.float32), ex)
    with pytest.raises(ValueError, match="expert 7"):
        ops.moe(x, np.full((3, 1), 7, np.int32), np.ones((3, 1), np.float32), ex)
    with pytest.raises(ValueError, match=r"x \[T, 12\]"):
        ops.moe(rand(rng, 3, 12), np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32), ex)
    with pytest.raises(ValueError, match="unknown kernel backend 'gpu'"):
        FastOps("gpu")  # type: ignore[arg-type]



def test_attention_positions_checked_for_few_and_many_rows() -> None:
    """q_pos: integers of shape (T,), each within the cached positions, whichever way the check
    runs (a decode step's few rows, or a prefill chunk's many); any integer dtype or layout
    gives the bits of int64."""
    ops = FastOps()
    rng = np.random.default_rng(1)
    for t in (1, 3, 64, 65, 130):
        q, k, v = rand(rng, t, 4, 8), rand(rng, t + 2, 2, 8), rand(rng, t + 2, 2, 8)
        pos = np.arange(2, t + 2, dtype=np.int64)
        want = ops.attention(q, k, v, pos, 0.5)
        for p in (pos.astype(np.int32), pos.astype(np.uint16), np.repeat(pos, 2)[::2]):
            assert np.array_equal(bits(ops.attention(q, k, v, p, 0.5)), bits(want))
        for bad, what in ((pos - 3, r"q_pos -1\.\."), (pos + 1, rf"\.\.{t + 2} outside the {t + 2}")):
            with pytest.raises(ValueError, match=what):
                ops.attention(q, k, v, bad, 0.5)
        with pytest.raises(ValueError, match="q_pos must be integers"):
            ops.attention(q, k, v, pos.astype(np.float32), 0.5)
        with pytest.raises(ValueError, match="q_pos must be integers"):
            ops.attention(q, k, v, pos > 0, 0.5)
    ex = experts_of(rng, 2, 16, 8, "int4", 8)
    with pytest.raises(ValueError, match="ids must be integers, got float32"):
        ops.moe(rand(rng, 3, 16), np.zeros((3, 1), np.float32), np.ones((3, 1), np.float32), ex)

def test_empty_batches() -> None:
    ops = FastOps()
    w = quantize(np.ones((4, 10), np.float32), "int8", 8)
    assert ops.linear(np.zeros((0, 10), np.float32), w).shape == (0, 4)
    ex = {0: ExpertWeights(w, w, quantize(np.ones((10, 4), np.float32), "int8", 8))}
    assert ops.moe(np.zeros((0, 10), np.float32), np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32),
                   ex).shape == (0, 10)


def test_warmup_runs() -> None:
    for b in BACKENDS:
        warmup(b)  # type: ignore[arg-type]


def test_concurrent_callers_and_thread_counts_give_the_same_bits() -> None:
    """Threads split output rows between them; neither their number nor a second caller
    running at the same time (which then computes alone) changes a bit."""
    import threading

    rng = np.random.default_rng(9)
    w = quantize(rand(rng, 300, 256), "int4", 64)
    x = rand(rng, 3, 256)
    want = FastOps(threads=1).linear(x, w)
    results: list[bool] = []

    def worker(threads: int) -> None:
        ops = FastOps(threads=threads)
        results.extend(same_bits(ops.linear(x, w), want) for _ in range(50))

    ths = [threading.Thread(target=worker, args=(n,)) for n in (1, 2, 3, 4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert len(results) == 200 and all(results)


def pool_stress(make_ops: Callable[[int], FastOps], callers_s: float, back_to_back_s: float,
                park: bool = False) -> None:
    """The C work pool under load: four Python threads (1 to 8 kernel threads each, more
    threads than cores) call linear, expert FFN, attention and moe with shapes whose jobs
    have from 1 to a few dozen chunks, in a different order each; then one caller issues
    tiny jobs back to back whose chunk counts alternate (2, 16, 4, 8), so that a new job
    starts while helpers are still leaving the previous one. Every result is checked bit
    for bit against a single-threaded run. A helper running a chunk of a finished job, or
    a caller returning before a chunk ends, shows up as wrong bits or a crash."""
    import threading
    import time

    rng = np.random.default_rng(21)
    calls: list[tuple[str, tuple[Any, ...]]] = []
    linears: list[tuple[int, int, int, QDType]] = [(256, 64, 1, "f32"), (2048, 64, 2, "f32"), (300, 256, 3, "int4"),
                                                   (16, 1024, 1, "f32"), (64, 1024, 5, "f32"), (900, 256, 1, "int8"),
                                                   (40, 64, 1, "bf16")]
    for r, c, t, dt in linears:
        calls.append(("linear", (rand(rng, t, c), quantize(rand(rng, r, c), dt, 32), rand(rng, r))))
    for t, h, hkv, s, dq, dv in [(1, 4, 4, 9, 16, 16), (3, 8, 2, 20, 40, 24), (1, 16, 1, 33, 32, 16)]:
        pos = np.sort(rng.integers(0, s, t)).astype(np.int64)
        calls.append(("attention", (rand(rng, t, h, dq), rand(rng, s, hkv, dq), rand(rng, s, hkv, dv), pos, 0.125)))
    for t, d, i in [(1, 128, 96), (4, 256, 64), (2, 64, 512), (128, 1024, 64)]:  # last: down has 2x gate's chunks
        calls.append(("expert_ffn", (rand(rng, t, d), experts_of(rng, 1, d, i, "int4", 32)[0])))
    ex = experts_of(rng, 4, 128, 160, "int4", 32)
    for t in (1, 6):
        calls.append(("moe", (rand(rng, t, 128), rng.integers(0, 4, (t, 2)).astype(np.int32),
                              rng.random((t, 2), dtype=np.float32), ex)))

    def run(ops: FastOps, j: int) -> np.ndarray:
        name, args = calls[j]
        return bits(getattr(ops, name)(*args))

    one = make_ops(1)
    want = [run(one, j) for j in range(len(calls))]
    wrong: list[tuple[int, str]] = []
    done = [0] * 4
    stop = time.monotonic() + callers_s

    def worker(n: int, threads: int) -> None:
        ops = make_ops(threads)
        order = np.random.default_rng(n)
        while done[n] < len(calls) or time.monotonic() < stop:  # every call at least once, however slow
            for j in order.permutation(len(calls)).tolist():
                if not np.array_equal(run(ops, j), want[j]):
                    wrong.append((threads, calls[j][0]))
                done[n] += 1
                if park:
                    park_helpers()  # while other callers' jobs may be running

    ths = [threading.Thread(target=worker, args=(n, threads)) for n, threads in enumerate((1, 2, 4, 8))]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert not wrong, f"{len(wrong)} of {sum(done)} calls gave other bits, e.g. {wrong[:5]}"

    tiny = [quantize(rand(rng, r, 64), "f32", 0) for r in (256, 2048, 512, 1024)]  # 2, 16, 4, 8 chunks
    x = rand(rng, 1, 64)
    tiny_want = [bits(one.linear(x, w)) for w in tiny]
    ops = make_ops(8)
    n_tiny = 0
    stop = time.monotonic() + back_to_back_s
    while n_tiny < 100 or time.monotonic() < stop:  # at least 100 jobs, however slow the machine
        for w, expect in zip(tiny, tiny_want, strict=True):
            assert np.array_equal(bits(ops.linear(x, w)), expect), f"after {n_tiny} back-to-back jobs"
            n_tiny += 1
            if park:
                park_helpers()


def _running_threads() -> list[int]:
    """Thread ids of this process, other than the caller, that are running or runnable."""
    import os
    import threading

    me, out = threading.get_native_id(), []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # the thread ended
        if state == "R" and int(tid) != me:
            out.append(int(tid))
    return out


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to see thread states")
def test_park_helpers_sends_polling_helpers_to_sleep_and_the_next_call_wakes_them() -> None:
    """A sleeping helper that one call wakes polls for the next even when the call finished
    before the helper ran (a halted vCPU wakes late; a small call is over by then), until
    park_helpers sends it back to sleep."""
    import time

    def wait_until(cond: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        return cond()

    rng = np.random.default_rng(3)
    w, x = quantize(rand(rng, 32, 256), "int4", 32), rand(rng, 1, 256)  # done in microseconds
    ops, one = FastOps("c", threads=2), FastOps("c", threads=1)
    want = bits(one.linear(x, w))
    before = idle_spin_us()
    try:
        set_idle_spin(0)
        assert np.array_equal(bits(ops.linear(x, w)), want)  # starts the helper if none runs yet
        assert wait_until(lambda: not _running_threads()), "helpers still running 10 s after a call without polling"
        set_idle_spin(60e6)  # a minute of polling: only park_helpers ends it within the test
        assert np.array_equal(bits(ops.linear(x, w)), want)
        assert wait_until(lambda: bool(_running_threads())), "the helper a call woke does not poll for the next"
        time.sleep(0.1)
        assert _running_threads(), "the helper a call woke stopped polling within 0.1 s of a minute"
        park_helpers()
        assert wait_until(lambda: not _running_threads()), "helpers still polling 10 s after park_helpers"
        assert np.array_equal(bits(ops.linear(x, w)), want)  # the next call wakes them, same bits
    finally:
        set_idle_spin(before)
        park_helpers()


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
@pytest.mark.parametrize("spin_us,park", [(0.0, False), (2000.0, False), (2000.0, True)],
                         ids=["helpers-sleep", "helpers-poll", "helpers-parked"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numba"])
def test_pool_under_concurrent_callers_and_back_to_back_jobs_gives_the_same_bits(backend: Backend,
                                                                                 spin_us: float, park: bool) -> None:
    """Every way an idle helper waits for the next job: sleeping at once (every job wakes it),
    polling (kernels.idle_spin_us), and polling cut short by `park_helpers` after every call,
    as the dense worker and the expert store do before waiting for each other."""
    before = idle_spin_us()
    set_idle_spin(spin_us)
    try:
        assert idle_spin_us() == spin_us
        pool_stress(lambda threads: FastOps(backend, threads=threads), callers_s=1.0, back_to_back_s=0.5,
                    park=park)
    finally:
        set_idle_spin(before)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_idle_spin_is_set_in_microseconds_and_refuses_negative_or_nan() -> None:
    before = idle_spin_us()
    try:
        set_idle_spin(150.5)
        assert idle_spin_us() == 150.5
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError, match="idle spin"):
                set_idle_spin(bad)
        assert idle_spin_us() == 150.5  # a refused value changes nothing
    finally:
        set_idle_spin(before)


def test_pool_with_stalls_injected_between_its_steps_gives_the_same_bits(tmp_path: Path) -> None:
    """The same stress on a build of the C kernels with MT_POOL_JITTER: every pool thread
    stalls at random between the steps of the claim protocol (see pool_jitter), which
    turns rare interleavings -- a helper preempted between reading the count of chunks
    left and claiming one, or between finishing a chunk and counting it, while the caller
    moves on to its next job -- into common ones. (The extension's previous protocol,
    which let the caller return while a helper still ran a chunk, failed this test in
    9 runs of 10, mostly with a segfault.)"""
    import importlib.util
    import shutil
    import subprocess
    import sys
    import sysconfig

    from moetier.kernels import fast

    cc = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if not sys.platform.startswith("linux") or not cc or not (Path(include) / "Python.h").exists():
        pytest.skip("builds the extension with cc on Linux: no compiler, Python headers or Linux here")
    srcs = sorted(str(p) for p in Path(fast.__file__).with_name("csrc").glob("*.c"))
    so = tmp_path / f"_ckernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    # the contract's flags (pyproject.toml), at -O1 to build in about two seconds: same bits
    subprocess.run([cc, "-O1", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-shared", "-fPIC",
                    "-DMT_POOL_JITTER", f"-I{include}", *srcs, "-o", str(so)], check=True)
    spec = importlib.util.spec_from_file_location("_ckernels", so)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def make_ops(threads: int) -> FastOps:
        ops = FastOps("numba", threads=threads)
        best = next(i for i, (_, runs) in enumerate(mod.isas()) if runs)  # the best path this CPU runs
        ops._k = fast._CBackend(mod, best, threads)  # the jittered build, same shapes and checks
        return ops

    pool_stress(make_ops, callers_s=0.5, back_to_back_s=1.5)


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_the_contract_exp_is_the_same_everywhere_and_accurate() -> None:
    """softmax, attention and SwiGLU use the contract's own exp: one value per input on
    every path (16 lanes or scalar, C or numba), within about 1 ulp of the true exp."""
    from moetier.kernels import _ckernels, _nbkernels

    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, -86.5, -86.49999, -87.0, 88.75, 88.7228, 88.72283, 88.3763]
    x = np.concatenate([np.linspace(-100, 100, 400_001, dtype=np.float32), np.array(special, np.float32),
                        np.random.default_rng(0).standard_normal(50_000).astype(np.float32) * 30])
    outs = []
    runs = [i for i, (_, ok) in enumerate(_ckernels.isas()) if ok]  # every C path here, portable last
    for run in [*(lambda y, i=i: _ckernels.exp(x, x.size, y, i) for i in runs), lambda y: _nbkernels.exp(x, y)]:
        y = np.empty_like(x)
        run(y)
        outs.append(y)
    assert all(same_bits(outs[0], o) for o in outs[1:])
    y = outs[0]
    with np.errstate(over="ignore"):
        true = np.exp(x.astype(np.float64))
    inside = (x >= -86.5) & (x < 88.72)
    ulps = np.abs(y[inside] - true[inside]) / np.spacing(true[inside].astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.5
    assert np.isnan(y[x != x]).all()
    assert (y[x < -86.5] == 0).all() and (y[x > 88.75] == np.inf).all()


def test_c_kernels_are_built_where_a_compiler_exists() -> None:
    """The extension is optional in the install (so a machine without a compiler still
    installs); where a compiler exists a missing or stale build is a mistake to report."""
    import shutil

    from moetier.kernels import c_problem

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the numba kernels serve")
    assert c_available(), c_problem()


# ---------------------------------------------------------------- gpt-oss: mxfp4, sinks, windows, clamped SwiGLU


def mxfp4_source(rng: np.random.Generator, rows: int, cols: int) -> QTensor:
    """Checkpoint-style MXFP4 bytes: every nibble code (the -0 code 8 included) and scales from
    2^-127 (the subnormal) to 2^8."""
    g = -(-cols // 32)
    blocks = rng.integers(0, 256, (rows, g, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, (rows, g), dtype=np.uint8)
    scales[0, 0] = 0
    return mxfp4_tensor(blocks, scales, cols)


def test_mxfp4_dequantizes_to_the_ocp_values() -> None:
    """e2m1 * 2^(e - 127), computed independently in float64 with ldexp (the way transformers
    decodes gpt-oss's experts), low nibble first, -0 kept."""
    rng = np.random.default_rng(51)
    w = mxfp4_source(rng, 5, 70)
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    want = np.zeros((5, 96))
    for r in range(5):
        for c in range(96):
            b = int(w.data[r, c // 2])
            want[r, c] = np.ldexp(lut[(b >> 4) if c % 2 else (b & 15)], int(w.scales[r, c // 32]) - 127)
    got = w.dequantize()
    assert got.shape == (5, 70)
    assert same_bits(got, want[:, :70].astype(np.float32))
    assert np.signbit(got).any() and (got == 0).any()


def test_mxfp4_kernels_give_the_reference_values_and_the_same_bits_everywhere() -> None:
    rng = np.random.default_rng(52)
    all_ops = [FastOps(b, threads=2) for b in BACKENDS]
    for rows, cols in ((1, 32), (9, 64), (13, 100), (17, 2048), (6, 40)):
        w = mxfp4_source(rng, rows, cols)
        eye = np.eye(cols, dtype=np.float32)
        ref = w.dequantize().T
        for o in all_ops:  # against an identity input each output is one weight (up to the sign of 0)
            got = o.linear(eye, w)
            assert np.array_equal(got, ref) and same_bits(np.abs(got), np.abs(ref)), (o.backend, rows, cols)
        for t in (1, 2, 3, 4, 5, 9, 17, 40):
            x = rand(rng, t, cols)
            bias = rand(rng, rows) if t % 2 else None
            outs = [o.linear(x, w, bias) for o in all_ops]
            close(REF.linear(x, w, bias), outs[0])
            assert all(same_bits(got, outs[0]) for got in outs[1:]), (rows, cols, t)


def test_mxfp4_quantizer_rounds_to_the_grid_and_a_source_round_trips() -> None:
    rng = np.random.default_rng(53)
    x = rand(rng, 4, 64)
    q = quantize(x, "mxfp4")
    assert q.scales is not None and q.scales.dtype == np.uint8 and q.data.shape == (4, 32)
    err = np.abs(q.dequantize() - x)
    scale = np.repeat(np.exp2(q.scales.astype(np.float64) - 127), 32, axis=1)
    # half the widest grid step (2 * scale), or the clamp of values in (6, 8) * scale to 6
    assert (err <= 2 * scale + 1e-12).all() and relative_rms_error(x, q.dequantize()) < 0.2
    w = mxfp4_source(rng, 3, 64)
    back = mxfp4_tensor(w.data.reshape(3, 2, 16), w.scales, 64)  # the checkpoint's bytes, as they are
    assert np.array_equal(back.data, w.data) and np.array_equal(back.scales, w.scales)
    with pytest.raises(ValueError, match="do not hold"):
        mxfp4_tensor(w.data.reshape(3, 2, 16), w.scales[:, :1], 64)


def test_attention_sinks_and_window_match_the_reference_and_agree_everywhere() -> None:
    rng = np.random.default_rng(54)
    all_ops = [FastOps(b, threads=2) for b in BACKENDS]
    for h, hkv, dq, s, window in ((4, 2, 16, 23, 5), (8, 1, 40, 40, 8), (3, 3, 7, 9, 1), (6, 2, 16, 12, 0)):
        q, k, v = rand(rng, 6, h, dq), rand(rng, s, hkv, dq), rand(rng, s, hkv, dq)
        sinks = rand(rng, h) * 2
        pos = np.sort(rng.integers(0, s, 6))
        pos[-1] = s - 1
        want = REF.attention(q, k, v, pos, 0.3, sinks, window)
        outs = [o.attention(q, k, v, pos, 0.3, sinks, window) for o in all_ops]
        close(want, outs[0])
        assert all(same_bits(got, outs[0]) for got in outs[1:]), (h, hkv, dq, window)
        # one token at a time (the decode kernel) gives the bits of the whole block (the prefill kernel)
        for t in range(6):
            one = all_ops[0].attention(np.ascontiguousarray(q[t:t + 1]), k, v, pos[t:t + 1], 0.3, sinks, window)
            assert same_bits(one[0], outs[0][t])
        # keys outside the window do not matter
        if window:
            k2 = k.copy()
            k2[: max(0, int(pos[-1]) - window + 1)] = 1e6
            last = all_ops[0].attention(np.ascontiguousarray(q[-1:]), k2, v, pos[-1:], 0.3, sinks, window)
            assert same_bits(last[0], outs[0][-1])
    # a sink of -inf is no sink
    q, k, v = rand(rng, 2, 2, 8), rand(rng, 5, 1, 8), rand(rng, 5, 1, 8)
    pos = np.array([2, 4])
    no = np.full(2, -np.inf, dtype=np.float32)
    assert same_bits(all_ops[0].attention(q, k, v, pos, 0.5, no), all_ops[0].attention(q, k, v, pos, 0.5))
    with pytest.raises(ValueError, match="sinks"):
        all_ops[0].attention(q, k, v, pos, 0.5, np.zeros(3, dtype=np.float32))


def test_gpt_oss_experts_with_biases_and_clamped_swiglu() -> None:
    """Biased experts with the clamped SwiGLU: every backend the same bits, close to the reference;
    the clamp acts (inputs large enough to reach it)."""
    rng = np.random.default_rng(55)
    act = ExpertAct("clamped_swiglu", 1.702, 7.0)
    d, i = 64, 32
    ex = {e: ExpertWeights(mxfp4_source(rng, i, d), mxfp4_source(rng, i, d), quantize(rand(rng, d, i) * 0.1, "mxfp4"),
                           rand(rng, i), rand(rng, i), rand(rng, d), act) for e in range(3)}
    x = rand(rng, 7, d) * 0.05
    ids = rng.integers(0, 3, (7, 2)).astype(np.int32)
    wts = rng.random((7, 2), dtype=np.float32)
    outs = [FastOps(b, threads=2).moe(x, ids, wts, ex) for b in BACKENDS]
    close(REF.moe(x, ids, wts, ex), outs[0], rtol=1e-4)
    assert all(same_bits(got, outs[0]) for got in outs[1:])
    g = REF.linear(x, ex[0].gate, ex[0].gate_bias)
    assert (g > 7).any() and (g < -7).any()
    plain = {e: ExpertWeights(w.gate, w.up, w.down) for e, w in ex.items()}
    assert not np.allclose(FastOps("c" if c_available() else "numba").moe(x, ids, wts, plain), outs[0])


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_linears_together_give_each_linears_bits() -> None:
    """FastOps.linears (an attention layer's q, k, v in one job of the pool) gives what each
    linear gives alone, bit for bit, on every path, exact and with int8 activations: weights of
    several dtypes and group sizes, with and without bias, from one token to a prefill chunk."""
    rng = np.random.default_rng(43)
    cols = 256
    ws = [quantize(rand(rng, 40, cols), "int4", 64), quantize(rand(rng, 24, cols), "int8", 64),
          quantize(rand(rng, 17, cols), "bf16", 0), quantize(rand(rng, 8, cols), "int4", 32),
          quantize(rand(rng, 33, cols), "int4", 64)]
    biases = [rand(rng, 40), None, rand(rng, 17), None, None]
    for path in [b for b in BACKENDS if b != "numba"]:
        for act in ("exact", "int8"):
            ops = FastOps(path, threads=2, activations=act)  # type: ignore[arg-type]
            for t in (1, 3, 40):
                x = rand(rng, t, cols)
                together = ops.linears(x, list(zip(ws, biases, strict=True)))
                for got, w, b in zip(together, ws, biases, strict=True):
                    assert same_bits(got, ops.linear(x, w, b)), (path, act, t, w.dtype)
    with pytest.raises(ValueError, match="does not fit"):
        FastOps("c").linears(rand(rng, 2, 100), [(ws[0], None)])


@pytest.mark.skipif(not c_available(), reason="the C extension is not built")
def test_the_c_steps_are_their_numpy_definitions_to_the_bit() -> None:
    """combine_slots and Rope.apply run in C where the extension loaded (C_STEPS): the same
    bits as their numpy definitions, specials included, for every shape the forward makes."""
    from moetier.model.ops import C_STEPS, combine_slots_numpy
    from moetier.model.rope import Rope

    assert set(C_STEPS) == {"combine", "rope"}, "the C kernels loaded but did not install their steps"
    rng = np.random.default_rng(11)
    for t, k, d in [(1, 8, 2048), (5, 2, 7), (3, 1, 64), (0, 4, 16)]:
        ys, w = rand(rng, t, k, d), rand(rng, t, k)
        if t:
            ys[0, 0, :3] = [np.inf, -np.inf, -0.0]
            w[-1, -1] = -0.0
        assert np.array_equal(bits(combine_slots(ys, w)), bits(combine_slots_numpy(ys, w)))
    for interleave in (False, True):
        for t, heads, hd, pairs in [(1, 16, 128, 64), (4, 3, 80, 32), (2, 1, 64, 16), (0, 2, 8, 4)]:
            rope = Rope(rand(rng, pairs), 1.0, interleave)
            x, cos, sin = rand(rng, t, heads, hd), rand(rng, t, pairs), rand(rng, t, pairs)
            got, want = rope.apply(x, cos, sin), rope.apply_numpy(x, cos, sin)
            assert got.shape == x.shape
            assert np.array_equal(bits(got), bits(want)), (interleave, t, heads, hd, pairs)
    # a view the C step does not take (MLA's rope slice) goes the numpy way, same values
    x = rand(rng, 2, 4, 96)
    view = x[..., 32:]
    rope = Rope(rand(rng, 32), 1.0, False)
    cos, sin = rand(rng, 2, 32), rand(rng, 2, 32)
    assert np.array_equal(bits(rope.apply(view, cos, sin)), bits(rope.apply_numpy(np.ascontiguousarray(view), cos, sin)))


def test_gqa_block_refuses_misfits_by_name() -> None:
    """FastOps.gqa_block (the fused GQA layer; its bits are checked against the layer's steps in
    tests/test_model_forward.py): a cache, position or projection that does not fit is a
    ValueError naming it, before any kernel runs."""
    ops = FastOps()
    if ops.backend == "numba":
        pytest.skip("the fused layer is a C kernel call")
    rng = np.random.default_rng(2)
    d, h, hkv, hd, t, s = 32, 4, 2, 8, 1, 5
    proj = [(quantize(rand(rng, r, d), "int4", 8), None) for r in (h * hd, hkv * hd, hkv * hd)]
    wo = quantize(rand(rng, d, h * hd), "int4", 8)
    x, norm = rand(rng, t, d), rand(rng, d)
    cos, sin = rand(rng, t, 2), rand(rng, t, 2)
    kc, vc = np.zeros((s, hkv, hd), np.float32), np.zeros((s, hkv, hd), np.float32)

    def call(**kw: Any) -> Any:
        a: dict[str, Any] = dict(x=x, norm=norm, eps=1e-6, qkv=proj, wo=wo, bo=None, q_norm=None, k_norm=None,
                                 qk_mode=0, clip=None, heads=h, kv_heads=hkv, head_dim=hd, cos=cos, sin=sin,
                                 interleave=False, k_cache=kc, v_cache=vc, q_pos=np.array([s - 1]), scale=0.3,
                                 sinks=None, window=0)
        a.update(kw)
        return ops.gqa_block(**a)

    assert call().shape == (t, d)
    with pytest.raises(ValueError, match="k_cache must be a writeable C-contiguous float32"):
        call(k_cache=kc.astype(np.float64))
    with pytest.raises(ValueError, match=r"v_cache \(5, 2, 4\)"):
        call(v_cache=np.zeros((s, hkv, 4), np.float32))
    with pytest.raises(ValueError, match=r"projection of shape \(32, 32\) where the layer needs \(16, 32\)"):
        call(qkv=[proj[0], proj[0], proj[2]])
    with pytest.raises(ValueError, match="q_pos"):
        call(q_pos=np.array([s]))
    with pytest.raises(ValueError, match="k_norm"):
        call(qk_mode=1, q_norm=rand(rng, h * hd), k_norm=rand(rng, 3))


@pytest.mark.parametrize("dtype", ["f32", "int8", "int4"])
def test_route_softmax_chooses_as_the_router_does(ops: FastOps, dtype: str) -> None:
    """FastOps.route_softmax (the softmax router in one call) against the router's steps: the
    linear, the softmax, np.argsort(-scores, kind="stable")'s top k and their scores. Duplicated
    router rows tie (the lower expert first); a row of NaN inputs ranks by index."""
    rng = np.random.default_rng(5)
    e, c, k = 16, 64, 4
    w = rand(rng, e, c)
    w[[3, 9, 12]] = w[7]  # four experts with equal logits
    q = quantize(w, dtype, 32)
    h = rand(rng, 6, c)
    h[4] = np.nan
    bias = rand(rng, e)
    for b, n in ((None, k), (bias, k), (None, e)):  # n = e: every expert ranked, the ties among them
        got = ops.route_softmax(h, q, b, n)
        if got is None:
            assert ops.backend == "numba"
            return
        ids, chosen = got
        scores = ops.softmax(ops.linear(h, q, b))
        if b is None:  # the ties (a bias parts them)
            assert (scores[[0, 1, 2, 3, 5]][:, [3, 9, 12]] == scores[[0, 1, 2, 3, 5]][:, [7]]).all()
        want = np.argsort(-scores, axis=-1, kind="stable")[:, :n]
        assert ids.dtype == np.int32 and np.array_equal(ids, want)
        assert np.array_equal(bits(chosen), bits(np.take_along_axis(scores, want, axis=-1)))
        assert np.array_equal(ids[4], np.arange(n))
    with pytest.raises(ValueError, match="route_softmax"):
        ops.route_softmax(h, q, None, e + 1)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_moe_block_is_the_layers_steps(ops: FastOps, dtype: str) -> None:
    """FastOps.moe_block (a MoE layer of a table's experts in one call) gives the bits of its
    steps: rmsnorm, the softmax router (route_softmax, routing_weights: renormalised or not,
    scaled), moe_plain and the residual add; one token or many, with and without a logit bias.
    A routed expert the table lacks is refused by name; biased experts make no table."""
    rng = np.random.default_rng(9)
    d, i, e = 64, 32, 8
    ex = experts_of(rng, e, d, i, dtype, 32)
    router = quantize(rand(rng, e, d), dtype, 32)
    norm = (rng.random(d, dtype=np.float32) + 0.5).astype(np.float32)
    table = ops.expert_table([ex[n] for n in range(e)], d)
    if ops.backend == "numba":
        assert table is None
        return
    assert table is not None
    for t, k, renorm, scale, bias in ((1, 4, False, 1.0, None), (1, 3, True, 2.5, None), (5, 8, True, 1.0, rand(rng, e)),
                                      (9, 2, False, 0.7, None)):
        args = SimpleNamespace(norm_topk_prob=renorm, routed_scaling_factor=scale)
        x = rand(rng, t, d) * 3
        got, ids, wts = ops.moe_block(x, norm, 1e-5, router, bias, k, renorm, scale, table)
        h = ops.rmsnorm(x, norm, 1e-5)
        routed = ops.route_softmax(h, router, bias, k)
        assert routed is not None
        want_ids, chosen = routed
        want_w = routing_weights(chosen, args)  # type: ignore[arg-type]
        y = ops.moe_plain(h, want_ids, want_w, ex)
        assert y is not None
        assert np.array_equal(ids, want_ids) and np.array_equal(bits(wts), bits(want_w))
        assert np.array_equal(bits(got), bits(x + y))
    partial = ops.expert_table([ex[n] if n != int(ids[0, 0]) else None for n in range(e)], d)
    assert partial is not None
    with pytest.raises(ValueError, match="not in the table"):
        ops.moe_block(x, norm, 1e-5, router, bias, k, False, 1.0, partial)
    with pytest.raises(ValueError, match="moe_block"):
        ops.moe_block(x, norm, 1e-5, router, bias, e + 1, False, 1.0, table)
    w0 = ex[0]
    assert ops.expert_table([ExpertWeights(w0.gate, w0.up, w0.down, gate_bias=rand(rng, i))], d) is None


def test_np_sum_order_is_numpys() -> None:
    """The renormalisation's row sum in the fused MoE layer is numpy's float32 sum, bit for bit,
    for the k of every router (1..16) and beyond (pairwise blocks of 8, halves above 128): the
    fused call and the Python path agree only while this holds."""
    if not c_available():
        pytest.skip(f"the C kernels are not built here: {c_problem()}")
    from moetier.kernels import _ckernels as ck

    rng = np.random.default_rng(3)
    for n in (*range(1, 17), 23, 64, 129, 300):
        a = (rng.random((200, n), dtype=np.float32) ** 6 * rng.choice([1e-3, 1.0, 1e3], (200, n))).astype(np.float32)
        want = a.sum(axis=-1, keepdims=True)[:, 0]
        got = np.array([ck.np_sum(np.ascontiguousarray(r), n) for r in a], dtype=np.float32)
        assert np.array_equal(bits(got), bits(want)), n


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_moe_plain_is_expert_outputs_then_combine(ops: FastOps, dtype: str) -> None:
    """FastOps.moe_plain (the routed experts and the k-ordered combine in one call) gives the bits
    of expert_outputs into zeros then combine_slots, one token or many; None where an expert is
    missing or not a plain SwiGLU one (biases), so the caller takes those two steps."""
    rng = np.random.default_rng(8)
    d, i = 64, 32
    ex = experts_of(rng, 6, d, i, dtype, 32)
    for t, k in ((1, 4), (7, 2)):
        x = rand(rng, t, d)
        ids = rng.integers(0, 6, (t, k)).astype(np.int32)
        wts = rng.random((t, k), dtype=np.float32)
        got = ops.moe_plain(x, ids, wts, ex)
        if ops.backend == "numba":
            assert got is None
            return
        slots = np.zeros((t, k, d), np.float32)
        ops.expert_outputs(x, ids, ex, slots)
        assert got is not None and np.array_equal(bits(got), bits(combine_slots(slots, wts)))
        assert np.array_equal(bits(got), bits(ops.moe(x, ids, wts, ex)))
    missing = {e: w for e, w in ex.items() if e != int(ids[0, 0])}
    assert ops.moe_plain(x, ids, wts, missing) is None
    w0 = ex[int(ids[0, 0])]
    biased = {**ex, int(ids[0, 0]): ExpertWeights(w0.gate, w0.up, w0.down, gate_bias=rand(rng, i))}
    assert ops.moe_plain(x, ids, wts, biased) is None
    with pytest.raises(ValueError, match=r"weights \(7, 3\)"):
        ops.moe_plain(x, ids, rand(rng, 7, 3), ex)
