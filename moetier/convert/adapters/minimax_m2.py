"""MiniMax-M2 (minimax_m2): GQA attention with q/k RMSNorm over the whole projection (one
norm per layer, not per head) and partial rotary (rotate_half over the first hd *
partial_rotary_factor dims; released configs give `rotary_dim`); a sigmoid router whose
correction bias steers the choice only, top-k weights always renormalised, no groups, no
shared expert, no scaling; experts stored Mixtral-style as block_sparse_moe.experts.{e}.w1
(gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import GQA_ATTENTION, Adapter, AdapterError, require, rope_params
from .qwen_moe import gqa_softmax_args

_MOE = [
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.gate\.weight", "layers.{i}.moe.router"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.e_score_correction_bias", "layers.{i}.moe.router_bias"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<p>w1|w2|w3)\.weight", "expert"),
    # transformers 5 in-memory layout, when saved fused
    (r"model\.layers\.(?P<i>\d+)\.(block_sparse_moe|mlp)\.experts\.gate_up_proj(\.weight)?", "fused:gate_up"),
    (r"model\.layers\.(?P<i>\d+)\.(block_sparse_moe|mlp)\.experts\.down_proj(\.weight)?", "fused:down"),
]


class MinimaxM2(Adapter):
    model_type: ClassVar[str] = "minimax_m2"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + _MOE
    expert_names: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}
    expert_prefix: ClassVar[str] = "model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight"

    def _part(self, p: str) -> Any:
        return {"w1": "gate", "w3": "up", "w2": "down"}[p]

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "num_local_experts", "intermediate_size", "num_attention_heads", "hidden_size")
        sf = cfg.get("scoring_func", "sigmoid")
        if sf != "sigmoid":
            raise AdapterError(f"minimax_m2: scoring_func {sf!r} is not supported (expected sigmoid)")
        if cfg.get("qk_norm_type", "per_layer") != "per_layer" or cfg.get("use_qk_norm") is False:
            raise AdapterError(f"minimax_m2: qk norm {cfg.get('qk_norm_type')!r} (use_qk_norm "
                               f"{cfg.get('use_qk_norm')}) is not supported (expected per_layer)")
        heads = int(cfg["num_attention_heads"])
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        rp = rope_params(cfg)
        factor = rp.get("partial_rotary_factor")
        if factor is None:
            factor = int(cfg["rotary_dim"]) / hd if cfg.get("rotary_dim") else 1.0
        return gqa_softmax_args(
            {**cfg, "rope_parameters": {**rp, "partial_rotary_factor": float(factor)}},
            qk_norm="full",
            moe_layers=(True,) * int(cfg["num_hidden_layers"]),
            n_routed_experts=int(cfg["num_local_experts"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            intermediate_size=0,
            scoring_func="sigmoid",
            score_correction_bias=True,
            norm_topk_prob=True,  # the top-k sigmoid weights are always renormalised
        )
