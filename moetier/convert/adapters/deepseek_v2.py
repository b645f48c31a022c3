"""DeepSeek-V2 / V2-Lite: MLA attention with complex (interleaved) rope, softmax router,
greedy or group-limited-greedy (max per group) top-k, no renormalisation, shared experts."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import DENSE_MLP, MLA_ATTENTION, MOE_COMMON, Adapter, AdapterError
from .deepseek_v3 import mla_args


class DeepseekV2(Adapter):
    model_type: ClassVar[str] = "deepseek_v2"
    patterns: ClassVar[list[tuple[str, str]]] = MLA_ATTENTION + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        tm = cfg.get("topk_method") or "greedy"
        if tm not in ("greedy", "group_limited_greedy"):
            raise AdapterError(f"deepseek_v2: topk_method {tm!r} is not supported")
        sf = cfg.get("scoring_func", "softmax")
        if sf != "softmax":
            raise AdapterError(f"deepseek_v2: scoring_func {sf!r} is not supported (expected softmax)")
        cfg = {**cfg, "rope_interleave": True}
        return mla_args(
            cfg,
            scoring_func="softmax",
            group_score="max" if tm == "group_limited_greedy" else "none",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            norm_topk_prob=False,  # the HF DeepseekV2 router never renormalises
        )
