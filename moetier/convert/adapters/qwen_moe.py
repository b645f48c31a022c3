"""Qwen3-MoE and Qwen2-MoE: GQA attention (Qwen3: per-head q/k norm, explicit head_dim;
Qwen2: qkv bias), softmax router with optional renormalisation, decoder_sparse_step and
mlp_only_layers; Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate)."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import (
    DENSE_MLP,
    GQA_ATTENTION,
    MOE_COMMON,
    Adapter,
    eos_ids,
    moe_layers_sparse_step,
    require,
    rope_params,
)


def gqa_softmax_args(cfg: dict[str, Any], **extra: Any) -> ModelArgs:
    """Common GQA + softmax-router shape (Qwen-MoE, Mixtral, OLMoE)."""
    require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok")
    rp = rope_params(cfg)
    heads = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    fields: dict[str, Any] = dict(
        arch=str(cfg["model_type"]),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=hd,
        rope_theta=float(rp.get("rope_theta", 10000.0)),
        rope_dim=int(hd * float(rp.get("partial_rotary_factor", 1.0))),
        rope_scaling=None if rp.get("rope_type", "default") == "default" else rp,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        scoring_func="softmax",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
    )
    fields.update(extra)
    return ModelArgs(**fields)


class Qwen3Moe(Adapter):
    model_type: ClassVar[str] = "qwen3_moe"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "moe_intermediate_size")
        n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return gqa_softmax_args(
            cfg,
            qk_norm="head",
            qkv_bias=bool(cfg.get("attention_bias", False)),
            moe_layers=moe_layers_sparse_step(cfg, n_exp),
            n_routed_experts=n_exp,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )


class Qwen2Moe(Adapter):
    model_type: ClassVar[str] = "qwen2_moe"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + DENSE_MLP + MOE_COMMON
    expert_prefix: ClassVar[str] = "model.layers.{i}.mlp.experts.{e}.{p}.weight"

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "moe_intermediate_size")
        n_exp = int(cfg.get("num_experts") or 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return gqa_softmax_args(
            cfg,
            qkv_bias=bool(cfg.get("qkv_bias", True)),
            moe_layers=moe_layers_sparse_step(cfg, n_exp),
            n_routed_experts=n_exp,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_intermediate_size=shared,
            shared_expert_gate=shared > 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )

    def source_name(self, canonical: str) -> str:
        # Qwen2-MoE spells the shared MLP in the singular
        return super().source_name(canonical).replace(".shared_experts.", ".shared_expert.")
