"""OLMoE: GQA attention with q/k RMSNorm over the whole projection (not per head) and
optional clip_qkv; softmax router, top-k renormalised only when norm_topk_prob."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import GQA_ATTENTION, MOE_COMMON, Adapter, require
from .qwen_moe import gqa_softmax_args


class Olmoe(Adapter):
    model_type: ClassVar[str] = "olmoe"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "num_experts", "intermediate_size")
        clip = cfg.get("clip_qkv")
        return gqa_softmax_args(
            {**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)},
            qk_norm="full",
            qkv_bias=bool(cfg.get("attention_bias", False)),
            clip_qkv=None if clip is None else float(clip),
            moe_layers=(True,) * int(cfg["num_hidden_layers"]),
            n_routed_experts=int(cfg["num_experts"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            intermediate_size=0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
