"""The numeric operations the forward pass is built from, and their plain reference.

Every operation that reduces across features (matmul, norm, softmax, attention,
expert combine) goes through an `Ops` object, so the same forward code runs on
the plain numpy reference (`ReferenceOps`, the oracle) or on the fast kernels
(moetier.kernels.FastOps, the engine). Elementwise work stays in plain numpy.

Contract for every implementation:
  * inputs and outputs are float32, C-contiguous;
  * ROW-INVARIANT: row t of an output depends only on row t of the inputs (and,
    for attention, the keys visible to it) -- never on how many other rows are in
    the call or what they hold. The fast kernels guarantee this bit for bit,
    which is what lets continuous batching and chunked prefill reproduce the
    tokens of a request served alone. The reference only guarantees it to
    floating-point tolerance (it uses BLAS).

Shapes: T = rows, C = input features, R = output features, H/Hkv = heads,
S = cached positions, dq = query/key width, dv = value width, K = top-k, D = hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from moetier.weights.quant import ExpertWeights, QTensor, quantize, row_block

F32 = npt.NDArray[np.float32]


class Ops(Protocol):
    def linear(self, x: F32, w: QTensor, bias: F32 | None = None) -> F32:
        """x [T, C] @ w[R, C].T (+ bias [R]) -> [T, R]."""
        ...

    def rmsnorm(self, x: F32, weight: F32, eps: float) -> F32:
        """Row-wise x / sqrt(mean(x^2) + eps) * weight; x [T, C] -> [T, C]."""
        ...

    def softmax(self, x: F32) -> F32:
        """Row-wise softmax over the last axis; x [T, N] -> [T, N]."""
        ...

    def attention(self, q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], scale: float,
                  sinks: F32 | None = None, window: int = 0) -> F32:
        """Causal attention of T query rows against one sequence's S cached positions.

        q [T, H, dq], k [S, Hkv, dq], v [S, Hkv, dv], q_pos [T] positions in k/v:
        row t sees keys 0..q_pos[t] (window W > 0: q_pos[t] - W + 1 .. q_pos[t]). Query head h
        uses key/value head h // (H // Hkv). sinks [H]: one learned logit per head that takes
        part in the softmax's normalisation and attends to nothing (gpt-oss). Returns [T, H, dv].
        """
        ...

    def moe(self, x: F32, ids: npt.NDArray[np.int32], weights: F32, experts: Mapping[int, ExpertWeights]) -> F32:
        """Routed experts of one layer: out[t] = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]).

        x [T, D], ids/weights [T, K]; `experts` holds at least every id in `ids`.
        The sum over k runs in k order (0..K-1). Returns [T, D].
        Exactly `expert_outputs` over every routed expert into zeros, then `combine_slots`.
        """
        ...

    def expert_outputs(self, x: F32, ids: npt.NDArray[np.int32], experts: Mapping[int, ExpertWeights],
                       out: F32) -> None:
        """out[t, k] = FFN_{ids[t, k]}(x[t]) for every (row, slot) routed to an expert in `experts`;
        the other slots of out are left as they are. x [T, D], ids [T, K], out [T, K, D].

        The first half of `moe`, for a caller that has only some of a layer's experts at a time
        (the expert tier computing a batch union larger than its budget in waves): the waves
        fill one buffer, then `combine_slots` sums it exactly as `moe` would have.
        """
        ...


class ExpertProvider(Protocol):
    """Where a layer's routed experts are computed: in-process over a dict or a RAM/NVMe tier,
    or one ComputeExperts RPC per layer per step. Every implementation ends in `Ops.moe`, so
    where an expert came from never changes the result.

    A provider that holds every expert of a layer in this process's memory may also offer
    `resident_table(layer, ops, n_experts)`: the layer's experts as one kernel-side table
    (FastOps.expert_table), or None where it cannot now; MoeBlock.block then runs the layer's
    norm, router, experts and combine in one kernel call (the same bits) and reports it with
    `resident_done(layer, ids, rows, seconds)`."""

    def moe(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> F32:
        """Routed experts of `layer` over all rows of a step: x [T, D], ids/weights [T, K] -> [T, D]."""
        ...

    def prefetch(self, layer: int, ids: npt.NDArray[np.int32]) -> None:
        """Hint: `layer` will soon need experts `ids` [n] (sorted, unique). May do nothing."""
        ...


class MoeCall(Protocol):
    """A `moe` under way (see `start_moe`)."""

    def result(self) -> F32:
        """Wait for the routed experts' output [T, D] (raises what `moe` would raise)."""
        ...

    def abandon(self) -> None:
        """The caller will not ask for the result: release what the call holds."""
        ...


class DoneCall:
    """A `moe` computed already (a MoeCall whose result is there)."""

    def __init__(self, y: F32) -> None:
        self._y = y

    def result(self) -> F32:
        return self._y

    def abandon(self) -> None:
        pass


def start_moe(experts: ExpertProvider, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> MoeCall:
    """Start `experts.moe(layer, x, ids, weights)` and return it under way, so the caller can
    compute what does not depend on it (the shared expert) meanwhile. A provider that computes
    elsewhere (the expert store over gRPC) has `moe_start(layer, x, ids, weights) -> MoeCall`;
    for any other the call runs here and now. Either way the result is the same array: only
    when it is computed changes, never what."""
    begin = getattr(experts, "moe_start", None)
    if begin is not None:
        call: MoeCall = begin(layer, x, ids, weights)
        return call
    return DoneCall(experts.moe(layer, x, ids, weights))


def head_linears(ops: Ops, x: F32, w: QTensor, stride: int, offset: int, rows: int, *, transposed: bool,
                 out: F32 | None = None) -> F32:
    """Per head h of x [T, H, *], a linear with the stored rows W_h = w[h * stride + offset :
    + rows] (MLA's absorption matrices, read in place from the stored kv_b projection):

      transposed=False: out[t, h, :rows] = x[t, h, :C] @ W_h.T           (W_h [rows, C])
      transposed=True:  out[t, h, :C]    = x[t, h, :rows] @ W_h           (the rows are the inputs)

    x and out are C-contiguous [T, H, *] (out: [T, H, rows or C] when None; wider arrays keep
    their other columns). The bits are `ops.linear`'s with W_h (transposed: W_h.T as float32),
    exact activations whatever the ops' setting, and the ops' own implementation where they have
    one (FastOps.head_linears: the stored rows without a float32 copy)."""
    own = getattr(ops, "head_linears", None)
    if own is not None:
        result: F32 = own(x, w, stride, offset, rows, transposed=transposed, out=out)
        return result
    return head_linears_by_head(ops.linear, x, w, stride, offset, rows, transposed=transposed, out=out)


def head_linears_by_head(linear: Callable[[F32, QTensor], F32], x: F32, w: QTensor, stride: int, offset: int,
                         rows: int, *, transposed: bool, out: F32 | None = None) -> F32:
    """`head_linears` one head at a time through `linear` (transposed: a float32 copy of W_h.T
    per call, the values the stored rows dequantize to)."""
    t, heads = x.shape[:2]
    cols = w.shape[1]
    if out is None:
        out = np.empty((t, heads, cols if transposed else rows), dtype=np.float32)
    for h in range(heads):
        wh = row_block(w, h * stride + offset, rows)
        if transposed:
            wt = quantize(np.ascontiguousarray(wh.dequantize().T), "f32")
            out[:, h, :cols] = linear(np.ascontiguousarray(x[:, h, :rows]), wt)
        else:
            out[:, h, :rows] = linear(np.ascontiguousarray(x[:, h, :cols]), wh)
    return out


def linears(ops: Ops, x: F32, ws: Sequence[tuple[QTensor, F32 | None]]) -> list[F32]:
    """[ops.linear(x, w, bias) for (w, bias) in ws]: together where the ops can (FastOps.linears:
    one job of the kernels' pool), one by one otherwise; the same bits either way."""
    together = getattr(ops, "linears", None)
    if together is not None:
        return list(together(x, ws))
    return [ops.linear(x, w, b) for w, b in ws]


def wants_hints(experts: ExpertProvider) -> bool:
    """Whether prefetch hints can help `experts` now. A provider that can tell they cannot (its
    tier settled: see ExpertTier.settled) has `wants_hints() -> bool`; the model then skips
    predicting them for the step, which is work of the step's own. Any other wants them."""
    ask = getattr(experts, "wants_hints", None)
    return True if ask is None else bool(ask())


# The C kernels' versions of elementwise steps of the forward pass (combine_slots here,
# Rope.apply in moetier.model.rope): each is its numpy definition to the bit (every step one
# IEEE operation, in the same order; tests/test_kernels.py compares them), without numpy's
# cost per call on a decode step's small arrays. moetier.kernels installs them when the
# extension loads; without it the numpy definitions run.
C_STEPS: dict[str, Callable[..., None]] = {}


def install_c_steps(combine: Callable[..., None], rope: Callable[..., None]) -> None:
    C_STEPS.update(combine=combine, rope=rope)


def plain_f32(a: npt.NDArray[Any]) -> bool:
    """float32, C-contiguous and aligned: what a C step takes as it is."""
    return a.dtype == np.float32 and a.flags.c_contiguous and a.flags.aligned


def unique_ids(ids: Any) -> list[int]:
    """The distinct ids, ascending, as ints (np.unique's result; a decode step's few ids
    without its per-call cost)."""
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(a) <= 64:
        return sorted(set(a.tolist()))
    return np.unique(a).tolist()


def combine_slots(ys: F32, weights: F32) -> F32:
    """out[t] = sum_k weights[t, k] * ys[t, k], the sum elementwise in k order (0..K-1).
    ys [T, K, D], weights [T, K] -> [T, D]. The second half of every `Ops.moe`: one code path
    whether the slots were computed in one call or in waves, so both give the same bits."""
    t, k, d = ys.shape
    c = C_STEPS.get("combine")
    if c is not None and weights.shape == (t, k) and plain_f32(ys) and plain_f32(weights):
        y = np.empty((t, d), dtype=np.float32)
        c(ys, weights, t, k, d, y)
        return y
    return combine_slots_numpy(ys, weights)


def combine_slots_numpy(ys: F32, weights: F32) -> F32:
    """combine_slots's definition, in numpy."""
    t, k, d = ys.shape
    out = np.zeros((t, d), dtype=np.float32)
    for j in range(k):
        out += weights[:, j : j + 1] * ys[:, j]
    return out


def sigmoid(x: F32) -> F32:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right 0
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def silu(x: F32) -> F32:
    return (x / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def glu_clamped(g: F32, u: F32, alpha: float, limit: float) -> F32:
    """gpt-oss's clamped SwiGLU: (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)."""
    gc = np.minimum(g, np.float32(limit))
    uc = np.clip(u, -np.float32(limit), np.float32(limit))
    return ((uc + 1) * (gc * sigmoid(gc * np.float32(alpha)))).astype(np.float32, copy=False)


class ReferenceOps:
    """Plain numpy: dequantize, then BLAS. The oracle every fast kernel is tested against."""

    def linear(self, x: F32, w: QTensor, bias: F32 | None = None) -> F32:
        y = x @ w.dequantize().T  # [T, R]
        if bias is not None:
            y = y + bias
        return np.ascontiguousarray(y, dtype=np.float32)

    def rmsnorm(self, x: F32, weight: F32, eps: float) -> F32:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + eps) * weight).astype(np.float32)

    def softmax(self, x: F32) -> F32:
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)

    def attention(self, q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], scale: float,
                  sinks: F32 | None = None, window: int = 0) -> F32:
        t, h, _ = q.shape
        s, hkv, _ = v.shape
        rep = h // hkv
        kk = np.repeat(k, rep, axis=1)  # [S, H, dq]
        vv = np.repeat(v, rep, axis=1)  # [S, H, dv]
        scores = np.einsum("thd,shd->hts", q, kk) * scale  # [H, T, S]
        mask = np.arange(s)[None, :] > q_pos[:, None]  # [T, S]
        if window > 0:
            mask |= np.arange(s)[None, :] <= q_pos[:, None] - window
        scores = np.where(mask[None], -np.inf, scores)
        if sinks is not None:  # the sink is one more logit per head, dropped after the softmax
            sink_col = np.broadcast_to(sinks.astype(np.float32)[:, None, None], (h, t, 1))
            full = np.concatenate([scores, sink_col], axis=-1).astype(np.float32)  # [H, T, S + 1]
            p = self.softmax(full.reshape(h * t, s + 1)).reshape(h, t, s + 1)[..., :s]
            return np.ascontiguousarray(np.einsum("hts,shd->thd", p, vv), dtype=np.float32)
        p = self.softmax(scores.reshape(h * t, s).astype(np.float32)).reshape(h, t, s)
        out = np.einsum("hts,shd->thd", p, vv)  # [T, H, dv]
        return np.ascontiguousarray(out, dtype=np.float32)

    def moe(self, x: F32, ids: npt.NDArray[np.int32], weights: F32, experts: Mapping[int, ExpertWeights]) -> F32:
        t, k = ids.shape
        # per (row, slot) expert output, then a k-ordered sum
        ys = np.zeros((t, k, x.shape[1]), dtype=np.float32)  # [T, K, D]
        missing = set(np.unique(ids).tolist()) - set(experts)
        if missing:
            raise KeyError(f"moe: experts {sorted(missing)} are routed to but not given")
        self.expert_outputs(x, ids, experts, ys)
        return combine_slots(ys, weights)

    def expert_outputs(self, x: F32, ids: npt.NDArray[np.int32], experts: Mapping[int, ExpertWeights],
                       out: F32) -> None:
        for e in np.unique(ids):
            if int(e) not in experts:
                continue
            rows, slots = np.nonzero(ids == e)
            w = experts[int(e)]
            xe = x[rows]
            g, u = self.linear(xe, w.gate, w.gate_bias), self.linear(xe, w.up, w.up_bias)  # [n, I]
            hidden = glu_clamped(g, u, w.act.alpha, w.act.limit) if w.act.kind == "clamped_swiglu" else silu(g) * u
            out[rows, slots] = self.linear(hidden, w.down, w.down_bias)
