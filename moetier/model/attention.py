"""Attention layers: GQA (Mixtral, Qwen-MoE, OLMoE, GLM-4.5, gpt-oss) and MLA (DeepSeek-V2/V3).

gpt-oss's GQA adds a learned sink logit per head (in the softmax's denominator, attending to
nothing), an output-projection bias, and sliding-window layers that see their last W positions.

Legend: T = rows of the step (all sequences), n = rows of one sequence, S = its cached
positions, D = hidden, H = query heads, Hkv = key/value heads, hd = head dim,
C = kv_lora_rank, R = qk_rope_head_dim, N = qk_nope_head_dim, Dv = v_head_dim, Q = q_lora_rank.

Projections run once over all T rows; attention runs per sequence against its own cache.

MLA runs in the absorbed form for prefill and decode alike, so a prompt fed in chunks sees
exactly the arithmetic it sees in one piece:
    keys   = [c_kv | k_pe]        [S, 1, C + R]   (the cache row, one shared "head")
    values = c_kv                 [S, 1, C]
    query  = [q_nope W_UK_h | q_pe]  per head     [n, H, C + R]
    out_h  = (softmax(query . keys) values) W_UV_h^T                    [n, Dv]
which equals the expanded form k_nope = c_kv W_UK^T, v = c_kv W_UV^T.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs
from moetier.model.kv_cache import KVCache
from moetier.model.ops import Ops, head_linears, linears
from moetier.model.rope import Rope
from moetier.model.weights import vector
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a step."""

    cache: KVCache
    rows: slice  # its rows in the step's [T, ...] arrays
    positions: npt.NDArray[np.int64]  # [n] absolute positions of those rows: start .. end - 1
    # what one layer of the step hands to later ones (the DSA indexer's choice of positions)
    scratch: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        return int(self.positions[-1]) + 1


def _opt_vector(dense: Mapping[str, QTensor], name: str) -> F32 | None:
    return vector(dense[name]) if name in dense else None


class GqaAttention:
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], rope: Rope, scale: float,
                 prefix: str | None = None):
        """layer: the KV cache layer it writes; prefix: its tensors' names (default "layers.{layer}")."""
        p = f"{prefix or f'layers.{layer}'}.attn"
        self.args, self.layer, self.rope, self.scale = args, layer, rope, scale
        self.wq, self.wk, self.wv, self.wo = (dense[f"{p}.w{x}"] for x in "qkvo")
        self.bq, self.bk, self.bv = (_opt_vector(dense, f"{p}.b{x}") if args.qkv_bias else None for x in "qkv")
        self.bo = vector(dense[f"{p}.bo"]) if args.o_bias else None  # [D] (gpt-oss)
        self.sinks = vector(dense[f"{p}.sinks"]) if args.attn_sinks else None  # [H] (gpt-oss)
        self.window = args.window(layer)  # 0, or the positions a sliding-window layer sees
        norm = args.qk_norm != "none"
        self.q_norm = vector(dense[f"{p}.q_norm"]) if norm else None
        self.k_norm = vector(dense[f"{p}.k_norm"]) if norm else None
        self._fused: tuple[Any, F32, float, Any] | None = None  # (ops, norm, eps, its one-call layer)

    def _qk_norm(self, ops: Ops, x: F32, weight: F32 | None, heads: int) -> F32:
        if weight is None:
            return x
        eps = self.args.rms_norm_eps
        if self.args.qk_norm == "full":
            return ops.rmsnorm(x, weight, eps)  # over the whole projection [T, heads*hd]
        t = x.shape[0]
        per_head = ops.rmsnorm(x.reshape(t * heads, -1), weight, eps)  # [T*heads, hd]
        return per_head.reshape(t, -1)

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """h [T, D] (normed), cos/sin [T, P] -> [T, D]; writes k, v of every segment."""
        a = self.args
        t, hd = h.shape[0], a.head_dim
        q, k, v = linears(ops, h, [(self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)])  # one job
        q = self._qk_norm(ops, q, self.q_norm, a.num_heads)  # [T, H*hd]
        k = self._qk_norm(ops, k, self.k_norm, a.num_kv_heads)  # [T, Hkv*hd]; v [T, Hkv*hd]
        if a.clip_qkv is not None:
            c = np.float32(a.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = self.rope.apply(q.reshape(t, a.num_heads, hd), cos, sin)  # [T, H, hd]
        k = self.rope.apply(k.reshape(t, a.num_kv_heads, hd), cos, sin)  # [T, Hkv, hd]
        v = v.reshape(t, a.num_kv_heads, hd)  # [T, Hkv, hd]
        out = np.empty((t, a.num_heads, hd), dtype=np.float32)  # [T, H, hd]
        for seg in segments:
            seg.cache.put(self.layer, "k", seg.start, k[seg.rows])
            seg.cache.put(self.layer, "v", seg.start, v[seg.rows])
            first = seg.cache.start(self.layer)  # > 0 only in a sliding-window layer past its window
            out[seg.rows] = ops.attention(
                np.ascontiguousarray(q[seg.rows]),
                seg.cache.get(self.layer, "k", seg.end),  # [S, Hkv, hd]: positions first .. end - 1
                seg.cache.get(self.layer, "v", seg.end),  # [S, Hkv, hd]
                seg.positions - first,
                self.scale,
                self.sinks,
                self.window,
            )
        return ops.linear(out.reshape(t, a.num_heads * hd), self.wo, self.bo)  # [T, D]

    def block(self, ops: Ops, x: F32, norm: F32, eps: float, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """The residual stream after this layer: x + self(ops, rmsnorm(x, norm, eps), cos, sin,
        segments), x [T, D]. Where the ops have it (FastOps.gqa_layer) and the step holds one
        sequence, in one kernel call that runs the same steps on the same values (the same
        bits): a decode step's attention without a dozen calls from Python."""
        t = x.shape[0]
        # (not a subclass: gated attention and DeltaNet compute otherwise, in their own __call__)
        if (type(self) is GqaAttention and len(segments) == 1 and segments[0].rows == slice(0, t)
                and cos.shape == sin.shape == (t, self.rope.dim // 2) and self.rope.dim <= self.args.head_dim):
            run = self._fused_layer(ops, norm, eps)
            if run is not None:
                seg = segments[0]
                first, end = seg.cache.start(self.layer), int(seg.positions[-1]) + 1
                return run(x, cos, sin, seg.cache.get(self.layer, "k", end), seg.cache.get(self.layer, "v", end),
                           seg.positions - first if first else seg.positions)
        return x + self(ops, ops.rmsnorm(x, norm, eps), cos, sin, segments)

    def _fused_layer(self, ops: Ops, norm: F32, eps: float) -> Any:
        """ops' one-call layer (FastOps.gqa_layer) with this layer's arguments, made once per ops
        and norm; None where the ops have none."""
        got = self._fused
        if got is not None and got[0] is ops and got[1] is norm and got[2] == eps:
            return got[3]
        make = getattr(ops, "gqa_layer", None)
        a = self.args
        run = None if make is None else make(
            norm, eps, [(self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)], self.wo, self.bo, self.q_norm,
            self.k_norm, 0 if self.q_norm is None else 1 if a.qk_norm == "full" else 2, a.clip_qkv, a.num_heads,
            a.num_kv_heads, a.head_dim, self.rope.interleave, self.scale, self.sinks, self.window)
        self._fused = (ops, norm, eps, run)
        return run


class MlaAttention:
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], rope: Rope, scale: float,
                 prefix: str | None = None):
        """layer: the KV cache layer it writes; prefix: its tensors' names (default "layers.{layer}")."""
        p = f"{prefix or f'layers.{layer}'}.attn"
        self.args, self.layer, self.rope, self.scale = args, layer, rope, scale
        if args.q_lora_rank is None:
            self.wq: QTensor | None = dense[f"{p}.wq"]
        else:
            self.wq = None
            self.wq_a, self.wq_b = dense[f"{p}.wq_a"], dense[f"{p}.wq_b"]
            self.q_a_norm = vector(dense[f"{p}.q_a_norm"])
        self.wkv_a, self.wo = dense[f"{p}.wkv_a"], dense[f"{p}.wo"]
        self.kv_a_norm = vector(dense[f"{p}.kv_a_norm"])
        # The absorption matrices are read in place from the stored wkv_b [H * (N + Dv), C] (head h's
        # rows: W_UK_h [N, C], then W_UV_h [Dv, C]), as stored (no float32 copy; head_linears):
        #   q_nope [n, N] @ W_UK_h -> latent query [n, C]; latent context [n, C] @ W_UV_h^T -> [n, Dv].
        self.wkv_b = dense[f"{p}.wkv_b"]
        n, dv, c = args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
        if self.wkv_b.shape != (args.num_heads * (n + dv), c):
            raise ValueError(f"{p}.wkv_b has shape {self.wkv_b.shape}, want {(args.num_heads * (n + dv), c)}")

    def _query(self, ops: Ops, h: F32) -> tuple[F32, F32 | None]:
        """(q [T, H*(N+R)], the normed q latent q_a [T, Q] or None without q_lora)."""
        if self.wq is not None:
            return ops.linear(h, self.wq), None
        q_a = ops.rmsnorm(ops.linear(h, self.wq_a), self.q_a_norm, self.args.latent_norm_eps)  # [T, Q]
        return ops.linear(q_a, self.wq_b), q_a

    def _project(self, ops: Ops, h: F32, cos: F32, sin: F32) -> tuple[F32, F32, F32 | None]:
        """h [T, D] -> (absorbed query [T, H, C + R], latent row [T, C + R], q_a [T, Q] or None)."""
        a = self.args
        t, heads, n, c = h.shape[0], a.num_heads, a.qk_nope_head_dim, a.kv_lora_rank
        q_flat, q_a = self._query(ops, h)
        q = q_flat.reshape(t, heads, n + a.qk_rope_head_dim)  # [T, H, N + R]
        q_pe = self.rope.apply(q[..., n:], cos, sin)  # [T, H, R]
        kv = ops.linear(h, self.wkv_a)  # [T, C + R]
        c_kv = ops.rmsnorm(np.ascontiguousarray(kv[:, :c]), self.kv_a_norm, a.latent_norm_eps)  # [T, C]
        k_pe = self.rope.apply(kv[:, None, c:], cos, sin)[:, 0]  # [T, R]
        latent = np.concatenate([c_kv, k_pe], axis=-1)  # [T, C + R]

        query = np.empty((t, heads, c + a.qk_rope_head_dim), dtype=np.float32)  # [T, H, C + R]
        head_linears(ops, np.ascontiguousarray(q), self.wkv_b, n + a.v_head_dim, 0, n, transposed=True,
                     out=query)  # query[:, h, :C] = q_nope[:, h] @ W_UK_h
        query[:, :, c:] = q_pe
        return query, latent, q_a

    def _attend(self, ops: Ops, query: F32, seg: Segment) -> F32:
        """Causal attention of one segment's query rows [n, H, C + R] over its cache -> [n, H, C]."""
        keys = seg.cache.get(self.layer, "latent", seg.end)  # [S, C + R]
        return ops.attention(
            np.ascontiguousarray(query[seg.rows]),
            keys[:, None, :],  # [S, 1, C + R]
            np.ascontiguousarray(keys[:, None, : self.args.kv_lora_rank]),  # [S, 1, C]
            seg.positions,
            self.scale,
        )

    def _output(self, ops: Ops, ctx: F32) -> F32:
        """Latent context [T, H, C] -> [T, D]."""
        a = self.args
        t, heads = ctx.shape[:2]
        n = a.qk_nope_head_dim
        out = head_linears(ops, np.ascontiguousarray(ctx), self.wkv_b, n + a.v_head_dim, n, a.v_head_dim,
                           transposed=False)  # [T, H, Dv]: ctx[:, h] @ W_UV_h^T
        return ops.linear(out.reshape(t, heads * a.v_head_dim), self.wo)  # [T, D]

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        """h [T, D] (normed), cos/sin [T, P] -> [T, D]; writes the latent row of every segment."""
        query, latent, _ = self._project(ops, h, cos, sin)
        ctx = np.empty((h.shape[0], self.args.num_heads, self.args.kv_lora_rank), dtype=np.float32)  # [T, H, C]
        for seg in segments:
            seg.cache.put(self.layer, "latent", seg.start, latent[seg.rows])
            ctx[seg.rows] = self._attend(ops, query, seg)
        return self._output(ops, ctx)


class Attention(Protocol):
    """What a layer's token mixer is to the forward pass: GQA, MLA, DSA, a Gated DeltaNet."""

    def __call__(self, ops: Ops, h: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32: ...


def build_attention(args: ModelArgs, layer: int, dense: Mapping[str, QTensor], rope: Rope, scale: float,
                    prefix: str | None = None, indexer: bool | None = None) -> Attention:
    """The attention of cache layer `layer`, tensors under `prefix` (default "layers.{layer}");
    DSA: `indexer` says whether it runs its own (default: ModelArgs.indexer_layers[layer]); a
    hybrid model's linear layers run a Gated DeltaNet (moetier/model/deltanet.py)."""
    if args.linear_layers[layer] or args.attn_output_gate:
        from moetier.model.deltanet import GatedDeltaNet, GatedGqaAttention  # they extend GqaAttention

        if args.linear_layers[layer]:
            return GatedDeltaNet(args, layer, dense, prefix)
        return GatedGqaAttention(args, layer, dense, rope, scale, prefix)
    if args.attention == "mla":
        if args.index_topk:
            from moetier.model.dsa import DsaAttention  # it extends MlaAttention

            own = args.indexer_layers[layer] if indexer is None else indexer
            return DsaAttention(args, layer, dense, rope, scale, prefix, own)
        return MlaAttention(args, layer, dense, rope, scale, prefix)
    return GqaAttention(args, layer, dense, rope, scale, prefix)
