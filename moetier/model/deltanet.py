"""Hybrid linear attention (Qwen3-Next, Qwen3.5-MoE), as transformers 5.24 defines it
(`Qwen3NextGatedDeltaNet`, `Qwen3NextAttention`): Gated DeltaNet layers interleaved with gated
full attention (ModelArgs.layer_types).

Legend: T = rows of the step, n = rows of one sequence, D = hidden, Hk/Hv = key/value heads,
dk/dv = their head dims, r = Hv / Hk, C = conv channels (2 Hk dk + Hv dv), Kc = conv kernel,
H = attention heads, Hkv = attention key/value heads, hd = attention head dim.

Gated DeltaNet, per layer (tensors `layers.{i}.linear.*`):
    qkv  = wqkv(x)                                  [T, C]   q of every key head, k, v of every value head
    z, b, a = wz(x) [T, Hv*dv], wb(x) [T, Hv], wa(x) [T, Hv]
    qkv  = silu(causal depthwise conv over time, kernel Kc)   the last Kc-1 inputs are the conv state
    q, k = l2norm per head (eps 1e-6), q *= dk^-1/2; each key head serves r value heads
    beta = sigmoid(b),  g = -exp(a_log) * softplus(a + dt_bias)          [n, Hv]
    per token t, per value head, the recurrent state S [dk, dv]:
        S = S * exp(g_t);  S = S + k_t (x) ((v_t - S^T k_t) * beta_t);  o_t = S^T q_t
    out  = wo(RMSNorm(o) * norm * silu(z))           RMSNorm over dv per head
The state of a sequence is fixed-size: S per value head and the conv inputs (KVCache
`cache_state`). transformers runs prefill in chunks of 64 (the WY form) and decode token by
token; this module always runs the token recurrence, so a prompt fed in any chunks, alone or
in a batch, computes the same bits (the chunked form is the same sum in another order: within
the oracle's tolerance, docs/internals.md). As the loop passes a position the cache asked for
(`KVCache.save_at`), the state is copied: those are the positions the prefix cache can resume at.

Gated attention: GQA whose wq yields per head hd query rows then hd gate rows; the attention
output is multiplied by sigmoid(gate) before wo. Norms (1 + w in the source) were made plain
weights by the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from moetier.model.attention import GqaAttention, Segment
from moetier.model.config import ModelArgs
from moetier.model.ops import Ops, sigmoid, silu
from moetier.model.weights import vector
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]
L2_EPS = np.float32(1e-6)  # transformers' l2norm (the FLA library's)
SOFTPLUS_THRESHOLD = np.float32(20.0)  # torch.nn.functional.softplus: x above it is returned as is


def l2norm(x: F32) -> F32:
    """x [..., d] / sqrt(sum x^2 + eps) over the last axis."""
    return (x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)).astype(np.float32)


def softplus(x: F32) -> F32:
    with np.errstate(over="ignore"):
        return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(x))).astype(np.float32)


class GatedDeltaNet:
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], prefix: str | None = None):
        p = f"{prefix or f'layers.{layer}'}.linear"
        self.args, self.layer = args, layer
        self.wqkv, self.wz, self.wb, self.wa, self.wo = (dense[f"{p}.{n}"] for n in ("wqkv", "wz", "wb", "wa", "wo"))
        self.conv = np.ascontiguousarray(dense[f"{p}.conv"].dequantize(), dtype=np.float32)  # [C, Kc]
        self.decay = (-np.exp(vector(dense[f"{p}.a_log"]))).astype(np.float32)  # -exp(a_log) [Hv]
        self.dt_bias = vector(dense[f"{p}.dt_bias"])  # [Hv]
        self.norm = vector(dense[f"{p}.norm"])  # [dv]

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """h [T, D] (normed) -> [T, D]; writes the state of every segment (cos/sin unused)."""
        a = self.args
        t = h.shape[0]
        hv, dv = a.linear_num_value_heads, a.linear_value_head_dim
        qkv = ops.linear(h, self.wqkv)  # [T, C]
        z = ops.linear(h, self.wz)  # [T, Hv*dv]
        beta = sigmoid(ops.linear(h, self.wb))  # [T, Hv]
        g = self.decay * softplus(ops.linear(h, self.wa) + self.dt_bias)  # [T, Hv], <= 0
        out = np.empty((t, hv, dv), dtype=np.float32)  # [T, Hv, dv]
        for seg in segments:
            mixed = self._conv(qkv[seg.rows], seg)  # [n, C]
            out[seg.rows] = self._recur(mixed, beta[seg.rows], g[seg.rows], seg)
        normed = ops.rmsnorm(out.reshape(t * hv, dv), self.norm, a.rms_norm_eps).reshape(t, hv * dv)
        return ops.linear(np.ascontiguousarray(normed * silu(z)), self.wo)  # [T, D]

    def _conv(self, x: F32, seg: Segment) -> F32:
        """Causal depthwise convolution of one segment's inputs x [n, C] after the saved ones,
        then silu; writes the new conv state (and its snapshots)."""
        kc = self.args.linear_conv_kernel
        window = np.concatenate([seg.cache.state(self.layer, "conv"), x])  # [Kc-1+n, C]
        n = len(x)
        acc: np.ndarray = window[0:n] * self.conv[:, 0]  # [n, C] float32, taps summed oldest first
        for j in range(1, kc):
            acc = acc + window[j : j + n] * self.conv[:, j]
        seg.cache.put_state(self.layer, "conv", np.ascontiguousarray(window[n:]))
        for pos in seg.cache.save_at:
            if seg.start < pos <= seg.end:  # the inputs before position pos: window rows pos-start ..
                seg.cache.snapshot(pos, self.layer, "conv", window[pos - seg.start : pos - seg.start + kc - 1])
        return silu(acc.astype(np.float32))

    def _recur(self, mixed: F32, beta: F32, g: F32, seg: Segment) -> F32:
        """The gated delta rule over one segment's rows: mixed [n, C], beta/g [n, Hv] -> [n, Hv, dv]."""
        a = self.args
        hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
        n, r = len(mixed), hv // hk
        q = l2norm(mixed[:, : hk * dk].reshape(n, hk, dk)) * np.float32(dk**-0.5)  # [n, Hk, dk]
        k = l2norm(mixed[:, hk * dk : 2 * hk * dk].reshape(n, hk, dk))  # [n, Hk, dk]
        v = mixed[:, 2 * hk * dk :].reshape(n, hv, dv)  # [n, Hv, dv]
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # [n, Hv, dk]: value head j reads key head j // r
        decay = np.exp(g)  # [n, Hv]
        s = seg.cache.state(self.layer, "ssm").copy()  # [Hv, dk, dv]
        out = np.empty((n, hv, dv), dtype=np.float32)
        for j in range(n):
            s *= decay[j][:, None, None]
            kj = k[j][:, :, None]  # [Hv, dk, 1]
            mem = (s * kj).sum(axis=1)  # [Hv, dv]
            s += kj * ((v[j] - mem) * beta[j][:, None])[:, None, :]
            out[j] = (s * q[j][:, :, None]).sum(axis=1)
            pos = seg.start + j + 1  # s is now the state of positions [0, pos)
            if pos in seg.cache.save_at:
                seg.cache.snapshot(pos, self.layer, "ssm", s)
        seg.cache.put_state(self.layer, "ssm", s)
        return out


class GatedGqaAttention(GqaAttention):
    """GQA with an output gate: wq [2*H*hd, D] gives per head [q | gate]."""

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """h [T, D] (normed), cos/sin [T, P] -> [T, D]; writes k, v of every segment."""
        a = self.args
        t, hd, heads = h.shape[0], a.head_dim, a.num_heads
        qg = ops.linear(h, self.wq, self.bq).reshape(t, heads, 2 * hd)  # [T, H, 2hd]
        q = self._qk_norm(ops, np.ascontiguousarray(qg[..., :hd]).reshape(t, heads * hd), self.q_norm, heads)
        gate = np.ascontiguousarray(qg[..., hd:]).reshape(t, heads * hd)  # [T, H*hd]
        k = self._qk_norm(ops, ops.linear(h, self.wk, self.bk), self.k_norm, a.num_kv_heads)  # [T, Hkv*hd]
        v = ops.linear(h, self.wv, self.bv).reshape(t, a.num_kv_heads, hd)  # [T, Hkv, hd]
        q = self.rope.apply(q.reshape(t, heads, hd), cos, sin)  # [T, H, hd]
        k = self.rope.apply(k.reshape(t, a.num_kv_heads, hd), cos, sin)  # [T, Hkv, hd]
        out = np.empty((t, heads, hd), dtype=np.float32)  # [T, H, hd]
        for seg in segments:
            seg.cache.put(self.layer, "k", seg.start, k[seg.rows])
            seg.cache.put(self.layer, "v", seg.start, v[seg.rows])
            out[seg.rows] = ops.attention(np.ascontiguousarray(q[seg.rows]), seg.cache.get(self.layer, "k", seg.end),
                                          seg.cache.get(self.layer, "v", seg.end), seg.positions, self.scale)
        gated = out.reshape(t, heads * hd) * sigmoid(gate)  # [T, H*hd]
        return ops.linear(np.ascontiguousarray(gated, dtype=np.float32), self.wo)  # [T, D]
