"""Multi-token prediction (MTP) layers: DeepSeek-V3's MTP modules, as transformers 5.24's
`MtpLayer` / `MtpModel` compute them.

Legend: B = sequences, n = rows of one sequence, T = rows of the step, D = hidden, V = vocab.

MTP depth k (0-based) reads, at position p, the token of position p and a hidden state that
predicted it: the main model's final-normed hidden state of position p - 1 (depth 0), or the
previous depth's output at p - 1 (depth > 0):

    e   = enorm(embed(token[p]))                   [n, D]
    h   = hnorm(hidden[p - 1])                     [n, D]
    x   = eh_proj([e | h])                         [n, D]  (mtp_hidden_states_first: [h | e])
    x   = decoder block (attention + MoE) at position p, over this depth's own KV cache
    out = head_norm(x)                             [n, D]  -> logits = lm_head(out): the token at p + 1

Each depth has its own one-layer KVCache (`new_caches`), one entry per position from its first
(k + 1 at the earliest: no hidden state precedes position 0), in position order. Rope uses the
true positions; attention runs in entry space (row j sees entries 0..j), the same causal mask.

Drafting `k` tokens with one MTP layer chains it on its own output (depth 0 again, its output
as the hidden state), as inference engines do when drafting more tokens than the checkpoint has
MTP layers. The arithmetic is the main model's (Ops, row-invariant): a draft does not depend on
what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from moetier.model.attention import Attention, Segment, build_attention
from moetier.model.config import ModelArgs
from moetier.model.ffn import MoeBlock
from moetier.model.forward import Model
from moetier.model.kv_cache import KVCache, cache_layout
from moetier.model.ops import ExpertProvider
from moetier.model.rope import softmax_scale
from moetier.model.weights import embed_rows, vector
from moetier.weights.quant import QTensor
from moetier.weights.schema import mtp_shapes

F32 = npt.NDArray[np.float32]


@dataclass
class MtpLayer:
    depth: int
    enorm: F32  # [D]
    hnorm: F32  # [D]
    eh_proj: QTensor  # [D, 2D]
    attn_norm: F32
    ffn_norm: F32
    attention: Attention
    moe: MoeBlock
    head_norm: F32


def mtp_cache(args: ModelArgs) -> KVCache:
    """One MTP depth's cache: one layer of the main layout (DSA: with index keys, every MTP
    layer runs its own indexer)."""
    extra = {0: {"index_k": (args.index_head_dim,)}} if args.index_topk else {}
    return KVCache(cache_layout(args), 1, extra)


class MtpHead:
    """The MTP layers of a model, sharing its embedding, lm_head and rope.

    experts: provider of the MTP layers' routed experts, addressed as layer num_layers + k.
    """

    def __init__(self, main: Model, layers: int, dense: Mapping[str, QTensor], experts: ExpertProvider,
                 *, hidden_first: bool = False) -> None:
        if layers <= 0:
            raise ValueError(f"an MTP head needs at least one layer, got {layers}")
        args = main.args
        for name, shape in mtp_shapes(args, layers).items():
            t = dense.get(name)
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else list(t.shape)
                raise ValueError(f"MTP tensor {name!r} is {'missing' if t is None else got}, expected {list(shape)}")
        self.main, self.args, self.ops, self.experts = main, args, main.ops, experts
        self.hidden_first = hidden_first
        scale = softmax_scale(args)
        self.layers = [
            MtpLayer(
                depth=k,
                enorm=vector(dense[f"mtp.{k}.enorm"]),
                hnorm=vector(dense[f"mtp.{k}.hnorm"]),
                eh_proj=dense[f"mtp.{k}.eh_proj"],
                attn_norm=vector(dense[f"mtp.{k}.attn_norm"]),
                ffn_norm=vector(dense[f"mtp.{k}.ffn_norm"]),
                attention=build_attention(args, 0, dense, main.rope, scale, prefix=f"mtp.{k}", indexer=True),
                moe=MoeBlock(args, args.num_layers + k, dense, prefix=f"mtp.{k}"),
                head_norm=vector(dense[f"mtp.{k}.head_norm"]),
            )
            for k in range(layers)
        ]

    @property
    def depth(self) -> int:
        return len(self.layers)

    def new_caches(self) -> list[KVCache]:
        """Per sequence: one cache per MTP depth (entry j of depth k is position j + k + 1)."""
        return [mtp_cache(self.args) for _ in self.layers]

    def step(self, depth: int, batch: Sequence[tuple[KVCache, npt.NDArray[np.integer], F32, int]]) -> list[F32]:
        """Run MTP depth `depth` on new positions of several sequences, appending them to each
        one's cache of that depth: per sequence (cache, tokens [n] at positions pos0 .. pos0 + n - 1,
        hidden [n, D] of the positions before them, pos0). Returns per sequence the depth's output
        [n, D] (final-normed: `main.head` gives the draft logits; the next depth reads it as its
        hidden state). A step that raises leaves the caches unchanged."""
        if not batch:
            return []
        layer = self.layers[depth]
        ops, eps = self.ops, self.args.rms_norm_eps
        segments, ids, hid, pos = [], [], [], []
        row = 0
        for cache, toks, hidden, pos0 in batch:
            t = np.asarray(toks, dtype=np.int64).reshape(-1)
            if len(t) == 0 or hidden.shape != (len(t), self.args.hidden_size):
                raise ValueError(f"MTP step: {len(t)} tokens with hidden states of shape {hidden.shape}")
            if not cache.same_shape(mtp_cache(self.args)):
                raise ValueError("MTP cache was made for a different model shape")
            start = cache.reserve(len(t))
            entries = np.arange(start, start + len(t), dtype=np.int64)
            segments.append(Segment(cache, slice(row, row + len(t)), entries))
            ids.append(t)
            hid.append(hidden)
            pos.append(np.arange(pos0, pos0 + len(t), dtype=np.int64))  # true positions (rope)
            row += len(t)
        cos, sin = self.main.rope.cos_sin(np.concatenate(pos))
        e = ops.rmsnorm(embed_rows(self.main.embed, np.concatenate(ids)), layer.enorm, eps)  # [T, D]
        h = ops.rmsnorm(np.ascontiguousarray(np.concatenate(hid), dtype=np.float32), layer.hnorm, eps)  # [T, D]
        eh = np.concatenate([h, e] if self.hidden_first else [e, h], axis=-1)  # [T, 2D]
        x = ops.linear(np.ascontiguousarray(eh), layer.eh_proj)  # [T, D]
        x = x + layer.attention(ops, ops.rmsnorm(x, layer.attn_norm, eps), cos, sin, segments)
        f = ops.rmsnorm(x, layer.ffn_norm, eps)
        ids_k, weights = layer.moe.router.route(ops, f)
        x = x + layer.moe(ops, self.experts, f, ids_k, weights)  # [T, D]
        out = ops.rmsnorm(np.ascontiguousarray(x), layer.head_norm, eps)  # [T, D]
        for seg, t in zip(segments, ids, strict=True):
            seg.cache.commit(t)
        return [out[s.rows] for s in segments]
