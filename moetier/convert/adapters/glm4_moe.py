"""GLM-4.5 / GLM-4.6 (glm4_moe): GQA attention with partial rotary (rotate_half over the
first hd * partial_rotary_factor dims), optional per-head q/k norm and qkv bias; the MoE
block is DeepSeek-V3's (sigmoid, correction bias, groups, shared experts, first_k_dense)."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import (
    DENSE_MLP,
    GQA_ATTENTION,
    MOE_COMMON,
    Adapter,
    eos_ids,
    moe_layers_first_k,
    require,
    rope_params,
)
from .deepseek_v3 import sigmoid_router


class Glm4Moe(Adapter):
    has_mtp: ClassVar[bool] = True
    model_type: ClassVar[str] = "glm4_moe"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        rp = rope_params(cfg)
        heads = int(cfg["num_attention_heads"])
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        n_exp = int(cfg["n_routed_experts"])
        moe_i = int(cfg["moe_intermediate_size"])
        return ModelArgs(
            arch="glm4_moe",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=hd,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            qk_norm="head" if cfg.get("use_qk_norm") else "none",
            rope_theta=float(rp.get("rope_theta", 10000.0)),
            rope_dim=int(hd * float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))),
            rope_scaling=None if rp.get("rope_type", "default") == "default" else rp,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            moe_layers=moe_layers_first_k(cfg, n_exp),
            n_routed_experts=n_exp,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=moe_i,
            shared_intermediate_size=int(cfg.get("n_shared_experts") or 0) * moe_i,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg),
            **sigmoid_router(cfg),
        )
