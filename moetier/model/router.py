"""The MoE router (gate): which K of the E routed experts each token uses, and their weights.

Legend: T = rows, D = hidden, E = routed experts, K = experts per token, G = expert groups.

    scores  = softmax(x @ router.T)  or  sigmoid(x @ router.T)        [T, E]
              (gpt-oss, topk_softmax: ids = top-K of x @ router.T + logit_bias,
               weights = softmax over those K logits)
    choice  = scores (+ router_bias: DeepSeek-V3 correction, choice only)
    groups  = optional group limit: keep the topk_group groups ranked by
              max (DeepSeek-V2) or sum of top-2 (DeepSeek-V3) of `choice`
    ids     = top-K of `choice` among the kept groups, best first           [T, K]
    weights = scores at ids (never the bias), optionally renormalised,
              times routed_scaling_factor                                   [T, K]

Ties break towards the lower expert id, so the choice is a pure function of the scores.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs
from moetier.model.ops import Ops, sigmoid
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


def top_k_desc(x: F32, k: int) -> npt.NDArray[np.int64]:
    """Indices of the k largest entries of each row, largest first, lower index on ties: [T, k]."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]


def group_limit(choice: F32, args: ModelArgs) -> F32:
    """Mask (to -inf) the experts outside each row's topk_group best groups: [T, E] -> [T, E]."""
    t, e = choice.shape
    g = choice.reshape(t, args.n_group, e // args.n_group)  # [T, G, E/G]
    if args.group_score == "max":
        group_scores = g.max(axis=-1)  # [T, G]
    else:  # top2_sum
        top2 = np.sort(g, axis=-1)[..., -2:]  # [T, G, 2]
        group_scores = top2[..., 1] + top2[..., 0]
    keep_groups = top_k_desc(group_scores, args.topk_group)  # [T, topk_group]
    keep = np.zeros((t, args.n_group), dtype=bool)
    np.put_along_axis(keep, keep_groups, True, axis=-1)
    keep_experts = np.repeat(keep, e // args.n_group, axis=-1)  # [T, E]
    return np.where(keep_experts, choice, np.float32(-np.inf)).astype(np.float32)


def select_experts(scores: F32, bias: F32 | None, args: ModelArgs) -> tuple[I32, F32]:
    """Router scores [T, E] -> (ids int32 [T, K], weights float32 [T, K])."""
    choice = scores + bias if bias is not None else scores
    if args.group_score != "none":
        choice = group_limit(choice, args)
    ids = top_k_desc(choice, args.num_experts_per_tok)  # [T, K]
    chosen = scores[np.arange(len(ids))[:, None], ids]  # [T, K] (take_along_axis's values, at less cost per call)
    return ids.astype(np.int32), routing_weights(chosen, args)


def routing_weights(chosen: F32, args: ModelArgs) -> F32:
    """The chosen experts' scores [T, K] -> their weights: optionally renormalised, times
    routed_scaling_factor."""
    weights = chosen
    if args.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    weights = weights * np.float32(args.routed_scaling_factor)
    return np.ascontiguousarray(weights, dtype=np.float32)


class Router:
    def __init__(self, args: ModelArgs, weight: QTensor, bias: F32 | None, logit_bias: F32 | None = None) -> None:
        self.args = args
        self.weight = weight  # [E, D]
        self.bias = bias if args.score_correction_bias else None  # [E]
        self.logit_bias = logit_bias  # [E]: added to the logits (gpt-oss)

    def scores(self, ops: Ops, x: F32) -> F32:
        """x [T, D] -> scores [T, E] (topk_softmax: the logits themselves)."""
        logits = ops.linear(x, self.weight, self.logit_bias)  # [T, E]
        if self.args.scoring_func == "sigmoid":
            return sigmoid(logits)
        if self.args.scoring_func == "topk_softmax":
            return logits
        return ops.softmax(logits)

    def route(self, ops: Ops, x: F32) -> tuple[I32, F32]:
        """x [T, D] -> (ids int32 [T, K], weights float32 [T, K])."""
        if self.args.scoring_func == "topk_softmax":  # gpt-oss: top-k of the logits, softmax over those k
            logits = self.scores(ops, x)
            ids = top_k_desc(logits, self.args.num_experts_per_tok)  # [T, K]
            top = np.ascontiguousarray(np.take_along_axis(logits, ids, axis=-1))  # [T, K]
            return ids.astype(np.int32), np.ascontiguousarray(ops.softmax(top), dtype=np.float32)
        fused = getattr(ops, "route_softmax", None)  # the softmax router in one kernel call, the same bits
        if fused is not None and self.plain_softmax:
            got = fused(x, self.weight, self.logit_bias, self.args.num_experts_per_tok)
            if got is not None:
                ids, chosen = got
                return ids, routing_weights(chosen, self.args)
        return select_experts(self.scores(ops, x), self.bias, self.args)

    @property
    def plain_softmax(self) -> bool:
        """A softmax router without a correction bias or expert groups: the choice that
        FastOps.route_softmax (and FastOps.moe_block) make in one kernel call."""
        a = self.args
        return a.scoring_func == "softmax" and self.bias is None and a.group_score == "none"
