"""DeepSeek-V3 (and GLM-5-style MLA shapes): MLA attention, sigmoid router with score
correction bias and group-limited top-k (top-2 sum per group), shared experts,
first_k_dense_replace dense layers, routed_scaling_factor."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import (
    DENSE_MLP,
    MLA_ATTENTION,
    MOE_COMMON,
    Adapter,
    AdapterError,
    eos_ids,
    moe_layers_first_k,
    require,
    rope_params,
)


def mla_args(cfg: dict[str, Any], **router: Any) -> ModelArgs:
    require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "vocab_size", "n_routed_experts", "num_experts_per_tok")
    rp = rope_params(cfg)
    n_exp = int(cfg["n_routed_experts"])
    moe_i = int(cfg["moe_intermediate_size"])
    return ModelArgs(
        arch=str(cfg["model_type"]),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_attention_heads"]),
        head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        attention="mla",
        q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(rp.get("rope_theta", 10000.0)),
        rope_dim=int(cfg["qk_rope_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        rope_scaling=None if rp.get("rope_type", "default") == "default" else rp,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
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
        **router,
    )


def sigmoid_router(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 router. Their HF configs carry no scoring_func: these models use
    sigmoid scores. An explicit scoring_func other than sigmoid is refused, never guessed."""
    sf = cfg.get("scoring_func", "sigmoid")
    if sf != "sigmoid":
        raise AdapterError(f"{cfg.get('model_type')}: scoring_func {sf!r} is not supported (expected sigmoid)")
    tm = cfg.get("topk_method", "noaux_tc")
    if tm not in ("noaux_tc", None):
        raise AdapterError(f"{cfg.get('model_type')}: topk_method {tm!r} is not supported (expected noaux_tc)")
    n_group = int(cfg.get("n_group") or 1)
    return dict(
        scoring_func="sigmoid",
        score_correction_bias=True,
        group_score="top2_sum" if n_group > 1 else "none",
        n_group=n_group,
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )


class DeepseekV3(Adapter):
    has_mtp: ClassVar[bool] = True
    model_type: ClassVar[str] = "deepseek_v3"
    patterns: ClassVar[list[tuple[str, str]]] = MLA_ATTENTION + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        return mla_args(cfg, **sigmoid_router(cfg))
