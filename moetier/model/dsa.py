"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 and GLM-5): MLA attending to the positions a
lightning indexer picks, as transformers 5.24 defines it (`DeepseekV32Indexer`, `GlmMoeDsaIndexer`).

Legend: T = rows of the step, n = rows of one sequence, S = its cached positions, D = hidden,
Q = q_lora_rank, R = qk_rope_head_dim, Hi = indexer heads, Di = indexer head dim,
k = index_topk, C = kv_lora_rank, H = attention heads.

The indexer, per layer that runs one (ModelArgs.indexer_layers):
    q      = wq_b(q_a)                             [T, Hi, Di]  q_a: MLA's normed q latent
    key    = LayerNorm(wk(x))                      [T, Di]      cached per position (index_k)
    rope on the first R dims of q and key          GLM-5: interleaved pairs; V3.2: halves
    w      = weights_proj(x) * Hi^-1/2             [T, Hi]
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . key[s] * Di^-1/2)      s <= pos[t]
    chosen[t]   = the min(k, pos[t] + 1) best positions s, ascending
A layer without its own indexer ("shared", GLM-5) reuses the choice of the last layer that ran
one, in the same step (handed on in `Segment.scratch`). MLA attention of row t then runs over
its chosen latent rows only, in position order: one `Ops.attention` call per row whose choice
drops positions, one causal call for the leading rows that still see every position (the
kernel contract makes both the same bits for such rows), so a row's output depends on its own
inputs alone and batching or chunking changes no bit.

Ties in the score (exact equality; relu makes all-zero scores possible) go to the lower
position. transformers takes torch.topk's choice, which is unspecified among ties. The official
kernels score in FP8 after a Hadamard rotation; transformers computes the rotation-free float
equivalent (the rotation is orthogonal), and so does this module: see docs/internals.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from moetier.model.attention import MlaAttention, Segment
from moetier.model.config import ModelArgs
from moetier.model.ops import Ops
from moetier.model.rope import Rope
from moetier.model.weights import vector
from moetier.weights.quant import QTensor, quantize

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
CHOICE = "dsa.chosen"  # Segment.scratch key: list of [m] int64 chosen positions per row of the segment
LAYER_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(Di, eps=1e-6) in both families


def layer_norm(ops: Ops, x: F32, weight: F32, bias: F32, eps: float) -> F32:
    """Row-wise LayerNorm x [T, C] -> [T, C], through Ops reductions (row-invariant):
    (x - mean) / sqrt(var + eps) * weight + bias == rmsnorm(x - mean) * weight + bias."""
    c = x.shape[1]
    ones = quantize(np.ones((1, c), dtype=np.float32), "f32")
    mean = ops.linear(x, ones) / np.float32(c)  # [T, 1]
    centred = np.ascontiguousarray(x - mean, dtype=np.float32)
    return (ops.rmsnorm(centred, weight, eps) + bias).astype(np.float32)


def choose(scores: F32, k: int) -> I64:
    """Positions of the k best scores [S] (lower position on ties), ascending: [min(k, S)]."""
    if len(scores) <= k:
        return np.arange(len(scores), dtype=np.int64)
    best = np.argsort(-scores, kind="stable")[:k]
    return np.sort(best).astype(np.int64)


class Indexer:
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], rope: Rope, prefix: str) -> None:
        p = f"{prefix}.attn"
        self.args, self.layer = args, layer
        self.rope = dataclasses.replace(rope, interleave=args.index_rope_interleave)
        self.wq_b = dense[f"{p}.index_wq_b"]  # [Hi*Di, Q]
        self.wk = dense[f"{p}.index_wk"]  # [Di, D]
        self.k_norm = vector(dense[f"{p}.index_k_norm"])  # [Di]
        self.k_bias = vector(dense[f"{p}.index_k_bias"])  # [Di]
        self.weights = dense[f"{p}.index_weights"]  # [Hi, D]
        self.scale = np.float32(args.index_head_dim**-0.5)
        self.head_weight = np.float32(args.index_n_heads**-0.5)

    def __call__(self, ops: Ops, x: F32, q_a: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> None:
        """x [T, D] (the attention input), q_a [T, Q]: writes each segment's index keys and puts
        every row's chosen positions in its segment's scratch."""
        a = self.args
        t, hi, di = x.shape[0], a.index_n_heads, a.index_head_dim
        q = self.rope.apply(ops.linear(q_a, self.wq_b).reshape(t, hi, di), cos, sin)  # [T, Hi, Di]
        key = layer_norm(ops, ops.linear(x, self.wk), self.k_norm, self.k_bias, LAYER_NORM_EPS)  # [T, Di]
        key = self.rope.apply(key[:, None, :], cos, sin)[:, 0]  # [T, Di]
        w = ops.linear(x, self.weights) * self.head_weight  # [T, Hi]
        for seg in segments:
            seg.cache.put(self.layer, "index_k", seg.start, key[seg.rows])
            keys = quantize(np.ascontiguousarray(seg.cache.get(self.layer, "index_k", seg.end)), "f32")  # [S, Di]
            qs = np.ascontiguousarray(q[seg.rows]).reshape(-1, di)  # [n*Hi, Di]
            dots = ops.linear(qs, keys).reshape(-1, hi, seg.end)  # [n, Hi, S]
            relu = np.maximum(dots * self.scale, np.float32(0))  # [n, Hi, S]
            ws = w[seg.rows]  # [n, Hi]
            score = ws[:, 0:1] * relu[:, 0]  # [n, S], heads summed in order
            for h in range(1, hi):
                score = score + ws[:, h : h + 1] * relu[:, h]
            seg.scratch[CHOICE] = [choose(score[j, : pos + 1], a.index_topk)
                                   for j, pos in enumerate(seg.positions.tolist())]


class DsaAttention(MlaAttention):
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], rope: Rope, scale: float,
                 prefix: str | None = None, indexer: bool = True):
        """indexer: runs its own indexer (False: reuses the choice of an earlier layer of the step)."""
        super().__init__(args, layer, dense, rope, scale, prefix)
        self.indexer = Indexer(args, layer, dense, rope, prefix or f"layers.{layer}") if indexer else None

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """h [T, D] (normed) -> [T, D]; writes the latent (and index key) rows of every segment."""
        a = self.args
        query, latent, q_a = self._project(ops, h, cos, sin)
        assert q_a is not None  # DSA models have a q_lora_rank (ModelArgs checks it)
        for seg in segments:
            seg.cache.put(self.layer, "latent", seg.start, latent[seg.rows])
        if self.indexer is not None:
            self.indexer(ops, h, q_a, cos, sin, segments)
        ctx = np.empty((h.shape[0], a.num_heads, a.kv_lora_rank), dtype=np.float32)  # [T, H, C]
        for seg in segments:
            ctx[seg.rows] = self._attend_chosen(ops, query, seg)
        return self._output(ops, ctx)

    def _attend_chosen(self, ops: Ops, query: F32, seg: Segment) -> F32:
        """One segment's rows [n, H, C + R] over their chosen positions -> [n, H, C]."""
        chosen: list[I64] | None = seg.scratch.get(CHOICE)
        if chosen is None:
            raise ValueError(f"layer {self.layer} reuses an indexer choice, but no earlier layer made one")
        c = self.args.kv_lora_rank
        keys = seg.cache.get(self.layer, "latent", seg.end)  # [S, C + R]
        q = np.ascontiguousarray(query[seg.rows])  # [n, H, C + R]
        out = np.empty((len(q), q.shape[1], c), dtype=np.float32)  # [n, H, C]
        # leading rows that still see every position: one causal call
        dense = 0
        for pos, ch in zip(seg.positions.tolist(), chosen, strict=True):
            if len(ch) != pos + 1:
                break
            dense += 1
        if dense:
            end = int(seg.positions[dense - 1]) + 1
            out[:dense] = ops.attention(q[:dense], keys[:end, None, :], np.ascontiguousarray(keys[:end, None, :c]),
                                        seg.positions[:dense], self.scale)
        for j in range(dense, len(q)):
            sel = keys[chosen[j]]  # [m, C + R] in position order
            m = np.array([len(sel) - 1], dtype=np.int64)
            out[j : j + 1] = ops.attention(q[j : j + 1], np.ascontiguousarray(sel[:, None, :]),
                                           np.ascontiguousarray(sel[:, None, :c]), m, self.scale)
        return out
