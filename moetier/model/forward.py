"""The model: a batched forward step over several sequences, each with its own KV cache.

Legend: B = sequences in the step, n_b = new tokens of sequence b, T = sum n_b (rows),
D = hidden, V = vocab, E = routed experts, K = experts per token.

One step (a prefill chunk or a decode token per sequence):
    x = embed(tokens)                                   [T, D]
    for each layer:
        [MoE layer, prediction on] router(ffn_norm(x)) -> prefetch hint for this layer, and
                                   the next MoE layers' routers on the same x -> their hints
                                   (each row's most confident picks only: PREFETCH_PLAN)
        x = x + attention(attn_norm(x))                 per sequence against its cache
        x = x + ffn(ffn_norm(x))                        dense MLP, or MoE: ONE provider call
    logits = lm_head(final_norm(x[last row of each sequence]))   [B, V]

Every matmul runs over the T concatenated rows; only attention is per sequence. With
row-invariant Ops, a sequence's logits do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from moetier.model.attention import Attention, Segment, build_attention
from moetier.model.config import ModelArgs
from moetier.model.ffn import MoeBlock, SwiGlu
from moetier.model.kv_cache import KVCache
from moetier.model.ops import ExpertProvider, Ops, wants_hints
from moetier.model.rope import Rope, softmax_scale
from moetier.model.weights import check_dense, embed_rows, vector
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
TokenIds = Sequence[int] | npt.NDArray[np.integer]

# Prefetch hints per MoE layer, from the hidden state entering it: for this layer and the next
# ones, how many of each row's top-k experts (by router weight) to hint. A later, closer hint for a
# layer supersedes an earlier one. Measured on mini-glm's decode (the share of hinted experts the
# layer then used, by rank): this layer's top 4 0.96 (all 6: 0.86), the next MoE layer's top 2 0.94
# (all: 0.75), the one after's top 1 0.93 (all: 0.68). A wrong hint is a wasted read of a disk
# that bounds the step (and an eviction), a right one starts a read one or two layers early: an
# LRU replay of those steps at a 25% budget read 3% more than the experts needed with this plan,
# 12% with every pick of this layer only and 27% with every pick of this layer and the next.
PREFETCH_PLAN = (4, 2, 1)


@dataclass
class PrefetchStats:
    """Gate prediction quality, summed over steps: per step and MoE layer, the experts predicted
    before attention (router on the hidden state entering the layer) vs the batch union used."""

    predicted: int = 0  # experts hinted
    actual: int = 0  # experts the layer then used
    hits: int = 0  # hinted and used
    by_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [predicted, actual, hits]

    def record(self, layer: int, predicted: I32, actual: I32) -> None:
        hits = len(np.intersect1d(predicted, actual, assume_unique=True))
        self.predicted += len(predicted)
        self.actual += len(actual)
        self.hits += hits
        row = self.by_layer.setdefault(layer, [0, 0, 0])
        row[0] += len(predicted)
        row[1] += len(actual)
        row[2] += hits

    @property
    def recall(self) -> float:
        """Share of used experts that were hinted (1.0 before any MoE layer ran)."""
        return self.hits / self.actual if self.actual else 1.0

    @property
    def precision(self) -> float:
        """Share of hinted experts that were used."""
        return self.hits / self.predicted if self.predicted else 1.0


@dataclass
class ModelStats:
    steps: int = 0
    tokens: int = 0  # rows processed (prefill + decode)
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    ahead: PrefetchStats = field(default_factory=PrefetchStats)  # the hints made one MoE layer earlier


@dataclass
class Layer:
    attn_norm: F32  # [D]
    ffn_norm: F32  # [D]
    attention: Attention
    mlp: SwiGlu | None  # dense layer
    moe: MoeBlock | None  # MoE layer


class Model:
    def __init__(
        self,
        args: ModelArgs,
        dense: Mapping[str, QTensor],
        ops: Ops,
        experts: ExpertProvider,
        *,
        predict_experts: bool = True,
        prefetch_plan: Sequence[int] = PREFETCH_PLAN,
    ) -> None:
        check_dense(args, dense)
        self.args, self.ops, self.experts = args, ops, experts
        self.predict_experts = predict_experts  # issue prefetch hints (and measure their recall)
        self._hinting = predict_experts  # this step's: off while the provider says hints cannot help
        # experts per row hinted for this MoE layer and the next ones (see PREFETCH_PLAN); reads for
        # a later layer get a whole layer's compute to overlap
        if not prefetch_plan or any(int(n) < 0 for n in prefetch_plan):
            raise ValueError(f"prefetch_plan {tuple(prefetch_plan)}: need experts per row >= 0, this layer first")
        self.prefetch_plan = tuple(int(n) for n in prefetch_plan)
        self.stats = ModelStats()
        self.rope = Rope.from_args(args)
        scale = softmax_scale(args)
        self.embed = dense["embed"]  # [V, D]
        self.lm_head = dense["embed"] if args.tie_word_embeddings else dense["lm_head"]  # [V, D]
        self.final_norm = vector(dense["final_norm"])
        self.layers = [
            Layer(
                attn_norm=vector(dense[f"layers.{i}.attn_norm"]),
                ffn_norm=vector(dense[f"layers.{i}.ffn_norm"]),
                attention=build_attention(args, i, dense, self.rope, scale),
                mlp=None if args.moe_layers[i] else SwiGlu(dense, f"layers.{i}.mlp"),
                moe=MoeBlock(args, i, dense) if args.moe_layers[i] else None,
            )
            for i in range(args.num_layers)
        ]
        moe_ids = [i for i in range(args.num_layers) if args.moe_layers[i]]
        self._moe_after = {a: moe_ids[n + 1:] for n, a in enumerate(moe_ids)}  # MoE layer -> the later ones
        self._ahead: dict[int, I32] = {}  # MoE layer -> the experts hinted for it one MoE layer earlier
        self._cache_shape = KVCache.for_model(args)  # every step's caches must have its shape (one, not one a step)

    def new_cache(self) -> KVCache:
        return KVCache.for_model(self.args)

    # ---- the step ---------------------------------------------------------------------
    def step(self, batch: Sequence[tuple[KVCache, TokenIds]], all_logits: bool = False) -> list[F32]:
        """Run new tokens of several sequences at once and append them to their caches.

        Returns, per sequence, the logits of its last token [V] (all_logits: of every new
        token, [n_b, V]). A step that raises leaves every cache unchanged.
        """
        if not batch:
            return []
        hidden = self.forward(batch, last_only=not all_logits)
        if all_logits:
            return [self.head(h) for h in hidden]
        return list(self.head(np.concatenate(hidden)))  # [B, V]

    def forward(self, batch: Sequence[tuple[KVCache, TokenIds]], last_only: bool = False) -> list[F32]:
        """The step without the lm_head: per sequence the final-normed hidden state of each new
        token [n_b, D] (last_only: of its last token, [1, D]), what `head` turns into logits and
        what a multi-token-prediction head reads."""
        if not batch:
            return []
        tokens = [self._check_tokens(np.asarray(t)) for _, t in batch]
        segments = self._segments([c for c, _ in batch], tokens)
        ids = np.concatenate(tokens)  # [T]
        pos = np.concatenate([s.positions for s in segments])  # [T]
        cos, sin = self.rope.cos_sin(pos)  # [T, P]

        x = embed_rows(self.embed, ids)  # [T, D]
        self._hinting = self.predict_experts and wants_hints(self.experts)
        if not self._hinting:
            self._ahead.clear()
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, segments)

        for seg, t in zip(segments, tokens, strict=True):
            seg.cache.commit(t)
        self.stats.steps += 1
        self.stats.tokens += len(ids)
        if last_only:
            x = x[np.array([s.rows.stop - 1 for s in segments])]  # [B, D]
            return list(self.final_normed(x)[:, None, :])
        h = self.final_normed(x)  # [T, D]
        return [h[s.rows] for s in segments]

    def final_normed(self, x: F32) -> F32:
        """The residual stream [n, D] after the final norm."""
        return self.ops.rmsnorm(np.ascontiguousarray(x), self.final_norm, self.args.rms_norm_eps)

    def head(self, h: F32) -> F32:
        """Final-normed hidden states [n, D] -> logits [n, V]."""
        return self.ops.linear(np.ascontiguousarray(h), self.lm_head)

    def _check_tokens(self, t: npt.NDArray[np.generic]) -> npt.NDArray[np.int64]:
        t = t.reshape(-1)
        if len(t) == 0:
            raise ValueError("a sequence in the step has no tokens")
        if not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {t.dtype}")
        if t.min() < 0 or t.max() >= self.args.vocab_size:
            raise ValueError(f"token id out of range [0, {self.args.vocab_size})")
        return t.astype(np.int64)

    def _segments(self, caches: Sequence[KVCache], tokens: Sequence[npt.NDArray[np.int64]]) -> list[Segment]:
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a KV cache appears twice in one step")
        shape = self._cache_shape
        out, row = [], 0
        for cache, t in zip(caches, tokens, strict=True):
            if not cache.same_shape(shape):
                raise ValueError("KV cache was made for a different model shape")
            start = cache.reserve(len(t))
            out.append(Segment(cache, slice(row, row + len(t)), np.arange(start, start + len(t), dtype=np.int64)))
            row += len(t)
        return out

    def _layer(self, i: int, layer: Layer, x: F32, cos: F32, sin: F32, segments: Sequence[Segment]) -> F32:
        ops, eps = self.ops, self.args.rms_norm_eps
        predicted = None
        if layer.moe is not None and self._hinting:
            # this layer first: its reads are needed soonest (prefetch reads are served in order)
            for n, j in enumerate([i, *self._moe_after[i]][: len(self.prefetch_plan)]):
                top = self.prefetch_plan[n]
                if top == 0:
                    continue
                guess = self._predict(self.layers[j], x, top)
                self.experts.prefetch(j, guess)
                if n == 0:
                    predicted = guess
                elif n == 1:
                    self._ahead[j] = guess

        block = getattr(layer.attention, "block", None)  # x + attention(rmsnorm(x)), fused where it can be
        if block is not None:
            x = block(ops, x, layer.attn_norm, eps, cos, sin, segments)  # [T, D]
        else:
            x = x + layer.attention(ops, ops.rmsnorm(x, layer.attn_norm, eps), cos, sin, segments)  # [T, D]

        moe = layer.moe
        if moe is None:
            assert layer.mlp is not None
            return x + layer.mlp(ops, ops.rmsnorm(x, layer.ffn_norm, eps))
        fused = moe.block(ops, self.experts, x, layer.ffn_norm, eps)  # x + moe(rmsnorm(x)), where it can be
        if fused is not None:
            x, ids = fused
        else:
            h = ops.rmsnorm(x, layer.ffn_norm, eps)  # [T, D]
            ids, weights = moe.router.route(ops, h)  # [T, K]
            x = x + moe(ops, self.experts, h, ids, weights)
        if predicted is not None:
            used = np.unique(ids).astype(np.int32)
            self.stats.prefetch.record(i, predicted, used)
            if i in self._ahead:
                self.stats.ahead.record(i, self._ahead.pop(i), used)
        return x

    def _predict(self, layer: Layer, x: F32, top: int) -> I32:
        """The `top` experts of each row the layer's router weighs most for the hidden state
        x [T, D]; sorted, unique."""
        assert layer.moe is not None
        guess, w = layer.moe.router.route(self.ops, self.ops.rmsnorm(x, layer.ffn_norm, self.args.rms_norm_eps))
        if top < guess.shape[1]:  # [T, K] -> [T, top], by weight (ties: the router's order)
            guess = np.take_along_axis(guess, np.argsort(-w, axis=1, kind="stable")[:, :top], axis=1)
        return np.unique(guess).astype(np.int32)  # [n] of the [T, top] guesses
