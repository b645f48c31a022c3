"""DeepSeek Sparse Attention families: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`).

Both are DeepSeek-V3 (MLA with a q latent, sigmoid router with correction bias, shared experts)
plus the lightning indexer of moetier/model/dsa.py in each layer. The differences, as
transformers 5.24 has them:
  * rope of the indexer: halves (rotate_half) in V3.2, interleaved pairs in GLM-5; the main MLA
    rope is interleaved in both (neither config has a rope_interleave switch);
  * GLM-5's `indexer_types`: per layer "full" (runs its indexer) or "shared" (reuses the last
    full layer's choice, and has no indexer weights); V3.2 runs an indexer in every layer.
    Without an explicit list GLM derives it from `index_topk_pattern` ("FSSF...") or from
    `index_topk_freq` / `index_skip_topk_offset`, as its config class does;
  * `mlp_layer_types` ("dense"/"sparse" per layer) when given, else first_k_dense_replace.
"""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import DENSE_MLP, MLA_ATTENTION, MOE_COMMON, Adapter, AdapterError, require
from .deepseek_v3 import mla_args, sigmoid_router

INDEXER: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.indexer\.wq_b\.weight", "layers.{i}.attn.index_wq_b"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.indexer\.wk\.weight", "layers.{i}.attn.index_wk"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.indexer\.k_norm\.weight", "layers.{i}.attn.index_k_norm"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.indexer\.k_norm\.bias", "layers.{i}.attn.index_k_bias"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.indexer\.weights_proj\.weight", "layers.{i}.attn.index_weights"),
]


# transformers 5.24's config defaults for the fields the math reads (a config.json may omit them)
_COMMON_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
    "index_topk": 2048, "index_head_dim": 128, "tie_word_embeddings": False, "attention_bias": False,
}
V32_DEFAULTS: dict[str, Any] = {**_COMMON_DEFAULTS, "n_group": 8, "topk_group": 4, "rms_norm_eps": 1e-6,
                                "max_position_embeddings": 163840, "index_n_heads": 64}
GLM5_DEFAULTS: dict[str, Any] = {**_COMMON_DEFAULTS, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
                                 "max_position_embeddings": 202752, "index_n_heads": 32}


def _with_defaults(cfg: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}


def _mlp_layers(cfg: dict[str, Any]) -> tuple[bool, ...] | None:
    types = cfg.get("mlp_layer_types")
    if types is None:
        return None
    n = int(cfg["num_hidden_layers"])
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise AdapterError(f"{cfg['model_type']}: mlp_layer_types must be {n} of 'dense'/'sparse', got {types}")
    return tuple(t == "sparse" for t in types)


def glm_indexer_types(cfg: dict[str, Any]) -> list[str]:
    """GlmMoeDsaConfig.__post_init__'s schedule of "full" and "shared" indexer layers."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("indexer_types")
    if types is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str):
                if any(ch not in "FS" for ch in pattern):
                    raise AdapterError(f"glm_moe_dsa: index_topk_pattern {pattern!r} is not made of F and S")
                types = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
            else:
                types = list(pattern)
        else:
            freq = max(int(cfg.get("index_topk_freq", 1)), 1)
            offset = int(cfg.get("index_skip_topk_offset", 2))
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in ("full", "shared") for t in types):
        raise AdapterError(f"glm_moe_dsa: indexer_types must be {n} of 'full'/'shared', got {types}")
    if types[0] != "full":
        raise AdapterError("glm_moe_dsa: layer 0 is a 'shared' indexer layer, with no earlier layer to share from")
    return types


def dsa_args(cfg: dict[str, Any], indexer_types: list[str], rope_interleave: bool) -> ModelArgs:
    require(cfg, "q_lora_rank", "index_topk", "index_n_heads", "index_head_dim")
    if cfg.get("attention_bias"):
        raise AdapterError(f"{cfg['model_type']}: attention_bias is not supported (no released model uses it)")
    if int(cfg["index_head_dim"]) < int(cfg["qk_rope_head_dim"]):
        raise AdapterError(f"{cfg['model_type']}: index_head_dim {cfg['index_head_dim']} is smaller than "
                           f"qk_rope_head_dim {cfg['qk_rope_head_dim']}")
    base = mla_args({**cfg, "rope_interleave": True}, **sigmoid_router(cfg))
    moe = _mlp_layers(cfg)
    return ModelArgs.from_dict({
        **base.to_dict(),
        "moe_layers": moe if moe is not None else base.moe_layers,
        "index_topk": int(cfg["index_topk"]),
        "index_n_heads": int(cfg["index_n_heads"]),
        "index_head_dim": int(cfg["index_head_dim"]),
        "index_rope_interleave": rope_interleave,
        "indexer_layers": [t == "full" for t in indexer_types],
    })


class DeepseekV32(Adapter):
    has_mtp: ClassVar[bool] = True
    model_type: ClassVar[str] = "deepseek_v32"
    patterns: ClassVar[list[tuple[str, str]]] = MLA_ATTENTION + INDEXER + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        cfg = _with_defaults(cfg, V32_DEFAULTS)
        return dsa_args(cfg, ["full"] * int(cfg["num_hidden_layers"]), rope_interleave=False)


class GlmMoeDsa(Adapter):
    has_mtp: ClassVar[bool] = True
    model_type: ClassVar[str] = "glm_moe_dsa"
    patterns: ClassVar[list[tuple[str, str]]] = MLA_ATTENTION + INDEXER + DENSE_MLP + MOE_COMMON

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "num_hidden_layers")
        cfg = _with_defaults(cfg, GLM5_DEFAULTS)
        return dsa_args(cfg, glm_indexer_types(cfg), rope_interleave=True)
