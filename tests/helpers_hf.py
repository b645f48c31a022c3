"""Tiny Hugging Face checkpoints for the oracle tests: make them, load them, run transformers.

Two generators, both a pure function of (preset, seed[, overrides]) and free of torch:
  * the project's synth (`moetier.convert.synth.write_hf_checkpoint`, presets `tiny-<arch>`):
    the checkpoints the rest of the project tests with;
  * `write_tiny_checkpoint` below: configs chosen to exercise every architecture quirk the
    synth presets leave at a neutral value (norm weights != 1, YaRN attention factor != 1,
    group-limited V2 routing, clip_qkv, tied embeddings, a dense Qwen3 layer, ...), plus
    config variants through `overrides`.
A fixture records generator, preset, seed, overrides and the xxh3 checksum of the weights,
so a test without torch rebuilds exactly the checkpoint transformers saw.

`hf_reference` is the only code that imports torch/transformers (lazily): the fixture script
and the live tests call it where those are installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors.numpy import load_file, save_file

from moetier.convert.adapters import Dense, Expert, FusedExperts, adapter_for
from moetier.model.config import ModelArgs
from moetier.model.experts import DictExperts
from moetier.model.forward import Model
from moetier.model.mtp import MtpHead
from moetier.model.ops import Ops, ReferenceOps
from moetier.weights.layout import model_layout
from moetier.weights.quant import ExpertWeights, QTensor, mxfp4_tensor, quantize
from moetier.weights.schema import dense_shapes, expert_shapes

ARCHS = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm_moe_dsa",
         "deepseek_v32", "minimax_m2", "qwen3_next", "qwen3_5_moe", "kimi_k25",
         "gpt_oss")
DSA_ARCHS = ("glm_moe_dsa", "deepseek_v32")
SYNTH_MODULE = "moetier.convert.synth"
HELPER_GENERATOR = "tests/helpers_hf.py"

_COMMON: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "hidden_act": "silu", "max_position_embeddings": 256,
    "initializer_range": 0.02, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "pad_token_id": None, "attention_dropout": 0.0, "dtype": "float32",
}
# Each exercises its architecture's quirks: yarn with mscale != mscale_all_dim, q_lora and
# groups (V3), no q_lora and max-per-group greedy (V2), partial rotary + qk norm + qkv bias
# (GLM), explicit head_dim and a dense layer (Qwen3), shared expert gate (Qwen2), clip_qkv +
# full-width qk norm + tied embeddings (OLMoE), an index_topk under the prompt length with a
# shared-indexer schedule given as a pattern, explicit mlp_layer_types (GLM-5), yarn with
# groups and index heads of another width (DeepSeek-V3.2), and partial rotary given as the
# released checkpoints' legacy `rotary_dim` (a quarter of the head) with per-layer q/k norm and
# a sigmoid router with its correction bias (MiniMax-M2).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "rope_interleave": True, "rms_norm_eps": 1e-6, "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                            "beta_fast": 32, "beta_slow": 1},
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 3,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
        "routed_scaling_factor": 1.5, "norm_topk_prob": False, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6,
        "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "glm4_moe": {
        "model_type": "glm4_moe", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "use_qk_norm": True,
        "attention_bias": True, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 16,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "attention_bias": False, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "qkv_bias": True, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "mixtral": {
        "model_type": "mixtral", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "sliding_window": None, "router_jitter_noise": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "glm_moe_dsa": {
        "model_type": "glm_moe_dsa", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "rms_norm_eps": 1e-5,
        "attention_bias": False, "index_topk": 6, "index_n_heads": 16, "index_head_dim": 16,
        "index_topk_pattern": "FSSF",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "deepseek_v32": {
        "model_type": "deepseek_v32", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "attention_bias": False, "index_topk": 5,
        "index_n_heads": 12, "index_head_dim": 24,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                            "beta_fast": 32, "beta_slow": 1},
    },
    "minimax_m2": {
        "model_type": "minimax_m2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 32, "num_local_experts": 16, "num_experts_per_tok": 4,
        "rms_norm_eps": 1e-6, "router_jitter_noise": 0.0, "rotary_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
    },
    # layer kinds from full_attention_interval (no layer_types), a dense layer, top-k unnormalised,
    # three value heads per key head, half of each attention head rotated, attention biases
    "qwen3_next": {
        "model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [0], "attention_bias": False, "rms_norm_eps": 1e-6, "full_attention_interval": 2,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # the text model of Qwen3.5-MoE: every layer MoE, top-k always renormalised, another conv width
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": 16, "num_experts_per_tok": 4, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 3,
        "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "layer_types": ["linear_attention", "full_attention"] * 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
    # a clamp that acts (limit 0.8 on O(1) activations), another alpha, a window of 3 in a
    # full-sliding-sliding pattern, three of sixteen experts, YaRN with truncation (the default)
    "gpt_oss": {
        "model_type": "gpt_oss", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 32, "num_local_experts": 16, "num_experts_per_tok": 3,
        "rms_norm_eps": 1e-5, "sliding_window": 3, "attention_bias": True, "swiglu_limit": 0.8,
        "swiglu_alpha": 1.3, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "router_aux_loss_coef": 0.0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 64},
    },
    "olmoe": {
        "model_type": "olmoe", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "clip_qkv": 1.5, "rms_norm_eps": 1e-5, "attention_bias": False, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


# Kimi K2.5: the wrapper around the DeepSeek-V3 quirk config (yarn, q_lora, groups), with a tiny
# vision tower config (its weights are not in the checkpoint: transformers initialises them, the
# text-only forward never reads them)
TINY_CONFIGS["kimi_k25"] = {
    "model_type": "kimi_k25", "text_config": {**_COMMON, **TINY_CONFIGS["deepseek_v3"], "model_type": "kimi_k2"},
    "vision_config": {"model_type": "kimi_k25_vision", "num_attention_heads": 2, "num_hidden_layers": 1,
                      "hidden_size": 32, "intermediate_size": 64, "pos_emb_height": 8, "pos_emb_width": 8},
    "projection_hidden_size": 32, "tie_word_embeddings": False, "dtype": "float32",
}
VISION_ONLY = ("model.vision_tower.", "model.mm_projector.")  # weights a text-only forward never reads


def tiny_config(arch: str) -> dict[str, Any]:
    if "text_config" in TINY_CONFIGS[arch]:
        return dict(TINY_CONFIGS[arch])
    return {**_COMMON, **TINY_CONFIGS[arch]}


# ---- making checkpoints -------------------------------------------------------------------
def _value(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded weights with O(1) activations and well-separated logits (so greedy decoding is
    decided by clear margins, not by rounding)."""
    z = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm"):
        return 1.0 + 0.1 * z
    if name.endswith(("bq", "bk", "bv", "router_bias", "index_k_bias", "attn.bo", "router_logit_bias", "gate_up_bias",
                      "down_bias")):
        return 0.1 * z
    if name.endswith("sinks"):
        return z
    return z / np.float32(np.sqrt(shape[-1]))


def write_tiny_checkpoint(arch: str, out_dir: Path, seed: int, overrides: dict[str, Any] | None = None) -> Path:
    """config.json + model.safetensors in the source layout, float32, weights from `seed`;
    `overrides` change config fields (variants the live tests compare)."""
    cfg = tiny_config(arch)
    if "text_config" in cfg:  # a wrapper (kimi_k25): the overrides are the text model's
        cfg["text_config"] = {**cfg["text_config"], **(overrides or {})}
    else:
        cfg = {**cfg, **(overrides or {})}
    adapter = adapter_for(arch)
    args = adapter.model_args(cfg)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    canonical = {name: _value(rng, name, shape) for name, shape in dense_shapes(args).items()}
    for src, parts in adapter.source_tensors(list(canonical), args):
        tensors[src] = adapter.to_source(src, {n: canonical[n] for n in parts}, args)
    for layer in args.moe_layer_ids:
        if args.expert_bias:  # gpt-oss: fused, interleaved, transposed (moetier/convert/adapters/gpt_oss.py)
            tensors.update(_gpt_oss_fused(rng, args, layer))
            continue
        for e in range(args.n_routed_experts):
            for part, shape in expert_shapes(args).items():
                tensors[adapter.expert_source_name(layer, e, part)] = _value(rng, part, shape)  # type: ignore[arg-type]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(dict(sorted(tensors.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _gpt_oss_fused(rng: np.random.Generator, args: ModelArgs, layer: int) -> dict[str, np.ndarray]:
    e, i, d = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    p = f"model.layers.{layer}.mlp.experts."
    gate, up = _value(rng, "gate", (e, i, d)), _value(rng, "up", (e, i, d))
    gate_up = np.empty((e, d, 2 * i), dtype=np.float32)
    gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    return {p + "gate_up_proj": gate_up, p + "gate_up_proj_bias": _value(rng, "gate_up_bias", (e, 2 * i)),
            p + "down_proj": _value(rng, "down", (e, d, i)).transpose(0, 2, 1).copy(),
            p + "down_proj_bias": _value(rng, "down_bias", (e, d))}


def synth_writer() -> Callable[..., Path] | None:
    """The project's synth, where it exists."""
    if importlib.util.find_spec(SYNTH_MODULE) is None:
        return None
    return getattr(importlib.import_module(SYNTH_MODULE), "write_hf_checkpoint", None)


def make_checkpoint(generator: str, preset: str, out_dir: Path, seed: int,
                    overrides: dict[str, Any] | None = None) -> Path:
    """Rebuild the float32 checkpoint of (generator, preset, seed, overrides); returns its directory."""
    if generator == SYNTH_MODULE:
        writer = synth_writer()
        if writer is None:
            raise RuntimeError(f"{SYNTH_MODULE}.write_hf_checkpoint is not available")
        if overrides and overrides != MXFP4_SOURCE:
            raise ValueError(f"synth presets take no config overrides (but {MXFP4_SOURCE}: gpt-oss's released form)")
        return Path(writer(preset, out_dir, seed, dtype="f32", mxfp4=bool(overrides)))
    if generator == HELPER_GENERATOR:
        return write_tiny_checkpoint(preset.removeprefix("tiny-"), out_dir, seed, overrides)
    raise ValueError(f"unknown checkpoint generator {generator!r}")


MXFP4_SOURCE = {"experts": "mxfp4"}  # a synth checkpoint whose experts are MXFP4 blocks and scales (gpt-oss)


@dataclass(frozen=True)
class Case:
    """One oracle comparison: a checkpoint recipe and how much to run on it."""

    name: str  # fixture file stem
    generator: str
    preset: str
    overrides: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 24
    greedy_tokens: int = 32
    seed: int = 0


# Config variants beyond the per-architecture quirk configs.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # no q_lora, rotate_half rope, no yarn, no groups, no renormalisation
    "deepseek_v3-plain": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    # greedy top-k, q_lora, DeepSeek-V2's own yarn (mscale == mscale_all_dim)
    "deepseek_v2-yarn": ("deepseek_v2", {
        "topk_method": "greedy", "q_lora_rank": 24,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "beta_fast": 32, "beta_slow": 1},
    }),
    # grouped sigmoid router, no qk norm, no bias
    "glm4_moe-groups": ("glm4_moe", {"n_group": 4, "topk_group": 2, "use_qk_norm": False, "attention_bias": False}),
}

CASES: dict[str, Case] = {
    **{a: Case(a, SYNTH_MODULE, f"tiny-{a}") for a in ARCHS},
    **{f"{a}-quirks": Case(f"{a}-quirks", HELPER_GENERATOR, f"tiny-{a}", prompt_tokens=16, greedy_tokens=16)
       for a in ARCHS},
    **{n: Case(n, HELPER_GENERATOR, f"tiny-{a}", ov, prompt_tokens=16, greedy_tokens=16)
       for n, (a, ov) in VARIANTS.items()},
    # gpt-oss as released: MXFP4 experts, which transformers decodes to float32
    "gpt_oss-mxfp4": Case("gpt_oss-mxfp4", SYNTH_MODULE, "tiny-gpt_oss", MXFP4_SOURCE),
}


def checkpoint_checksum(ckpt: Path) -> str:
    """xxh3_64 over the safetensors files (names and bytes, in name order)."""
    h = xxhash.xxh3_64()
    for f in sorted(ckpt.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ---- loading through the adapters ---------------------------------------------------------
def load_checkpoint(ckpt: Path) -> tuple[ModelArgs, dict[str, QTensor], dict[tuple[int, int], ExpertWeights]]:
    """A Hugging Face checkpoint -> (ModelArgs, canonical dense f32 QTensors, expert records)."""
    args, dense, _, experts = load_checkpoint_mtp(ckpt, with_mtp=False)
    return args, dense, experts


def load_checkpoint_mtp(ckpt: Path, with_mtp: bool = True) -> tuple[
        ModelArgs, dict[str, QTensor], dict[str, QTensor], dict[tuple[int, int], ExpertWeights]]:
    """(ModelArgs, dense, MTP dense `mtp.{k}.*`, expert records incl. the MTP layers' (num_layers + k))."""
    cfg = json.loads((ckpt / "config.json").read_text())
    adapter = adapter_for(cfg.get("model_type"))
    args = adapter.model_args(cfg)
    n_mtp = adapter.mtp_layers(cfg) if with_mtp else 0
    dense: dict[str, QTensor] = {}
    mtp: dict[str, QTensor] = {}
    parts: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, arr in load_file(str(f)).items():
            target = adapter.target(name, args, n_mtp)
            a = np.asarray(arr, dtype=np.float32)
            if isinstance(target, Dense):
                for cname, x in adapter.fix(target.name, a, args):
                    (mtp if cname.startswith("mtp.") else dense)[cname] = quantize(np.ascontiguousarray(x), "f32")
            elif isinstance(target, Expert):
                parts.setdefault((target.layer, target.expert), {})[target.part] = a
            elif isinstance(target, FusedExperts) and target.layout == "gpt_oss":
                _gpt_oss_parts(target, name, arr, f, parts, args)
            elif isinstance(target, FusedExperts):
                for e, m in enumerate(a):
                    p = parts.setdefault((target.layer, e), {})
                    if target.part == "gate_up":
                        p["gate"], p["up"] = np.split(m, 2, axis=0)
                    else:
                        p["down"] = m
    act = model_layout(args, "f32", 64).act
    experts = {
        key: ExpertWeights(*(quantize(np.ascontiguousarray(p[k]), "f32") for k in ("gate", "up", "down")),
                           *(np.ascontiguousarray(p[k], dtype=np.float32) if k in p else None
                             for k in ("gate_bias", "up_bias", "down_bias")), act=act)
        for key, p in parts.items()
    }
    return args, dense, mtp, experts


def _gpt_oss_parts(target: FusedExperts, name: str, arr: np.ndarray, shard: Path,
                   parts: dict[tuple[int, int], dict[str, np.ndarray]], args: ModelArgs) -> None:
    """gpt-oss's fused experts (moetier/convert/adapters/gpt_oss.py) into per-expert float32 parts:
    gate and up interleaved, dense matrices transposed, MXFP4 blocks decoded with their scales."""
    if name.endswith("_blocks"):
        scales = load_file(str(shard))[name.removesuffix("_blocks") + "_scales"]
        cols = args.hidden_size if target.part == "gate_up" else args.moe_intermediate_size
        mats = np.stack([mxfp4_tensor(b, s, cols).dequantize() for b, s in zip(arr, scales, strict=True)])
    else:
        a = np.asarray(arr, dtype=np.float32)
        mats = a if target.part.endswith("_bias") else np.ascontiguousarray(a.transpose(0, 2, 1))  # [E, R, C]
    for e, m in enumerate(mats):
        p = parts.setdefault((target.layer, e), {})
        if target.part == "gate_up":
            p["gate"], p["up"] = m[0::2], m[1::2]
        elif target.part == "gate_up_bias":
            p["gate_bias"], p["up_bias"] = m[0::2], m[1::2]
        elif target.part == "down_bias":
            p["down_bias"] = m
        else:
            p["down"] = m


def has_mtp(ckpt: Path) -> bool:
    cfg = json.loads((ckpt / "config.json").read_text())
    return adapter_for(cfg.get("model_type")).mtp_layers(cfg) > 0


def build_model_and_mtp(ckpt: Path, ops: Ops | None = None) -> tuple[Model, MtpHead]:
    """The model and its MTP head (every MTP layer the config announces), reference ops."""
    ops = ops or ReferenceOps()
    args, dense, mtp, experts = load_checkpoint_mtp(ckpt)
    provider = DictExperts(experts, ops)
    model = Model(args, dense, ops, provider)
    layers = len({n.split(".")[1] for n in mtp})
    return model, MtpHead(model, layers, mtp, provider)


def build_model(ckpt: Path, ops: Ops | None = None, **kw: Any) -> Model:
    ops = ops or ReferenceOps()
    args, dense, experts = load_checkpoint(ckpt)
    return Model(args, dense, ops, DictExperts(experts, ops), **kw)


def vocab_of(ckpt: Path) -> int:
    """The checkpoint's vocabulary size (a wrapper's: its text model's)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def prompt_ids(vocab_size: int, seed: int, n: int = 24) -> np.ndarray:
    return np.random.default_rng(seed + 1_000_003).integers(2, vocab_size, size=n).astype(np.int64)


# ---- the oracle ---------------------------------------------------------------------------
def hf_available() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


INDEX_TIE = 1e-5  # an indexer top-k boundary gap below this is a coin flip between implementations


def _check_loaded(ckpt: Path, model: Any, info: dict[str, Any]) -> None:
    """Nothing missing or mismatched; unexpected only the MTP layers (past the last layer)."""
    n = model.config.get_text_config().num_hidden_layers
    info = {**info, "missing_keys": {k for k in info.get("missing_keys") or () if not k.startswith(VISION_ONLY)}}
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "mismatched_keys")}
    unexpected = [k for k in info.get("unexpected_keys") or []
                  if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)]
    if bad or unexpected:
        raise RuntimeError(f"transformers did not load {ckpt} cleanly: {bad} unexpected {unexpected}")


class IndexGaps:
    """While installed on a transformers DSA model, records for every indexer call the smallest
    gap between the k-th and (k+1)-th best visible index score of any row: 0 means torch.topk
    chose among exact ties, which no implementation defines (the choice is then a coin flip)."""

    def __init__(self, model: Any) -> None:
        import torch

        self.smallest = float("inf")
        self._torch = torch
        self._inside = False
        for layer in getattr(model.model, "language_model", model.model).layers:
            ix = getattr(getattr(layer, "self_attn", None), "indexer", None)
            if ix is not None:
                ix.forward = self._wrap(ix.forward)
        real = torch.Tensor.topk
        rec = self

        def topk(t: Any, k: int, *a: Any, **kw: Any) -> Any:
            if rec._inside and t.shape[-1] > k:
                top = real(t, k + 1, dim=-1).values  # [..., k + 1]
                visible = top[..., k] > -1e30  # the causal mask adds finfo.min (or -inf)
                if bool(visible.any()):
                    rec.smallest = min(rec.smallest, float((top[..., k - 1] - top[..., k])[visible].min()))
            return real(t, k, *a, **kw)

        self._real, self._patched = real, topk

    def _wrap(self, fwd: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            self._inside = True
            self._torch.Tensor.topk = self._patched  # type: ignore[method-assign]
            try:
                return fwd(*a, **kw)
            finally:
                self._torch.Tensor.topk = self._real  # type: ignore[method-assign]
                self._inside = False
        return run


def hf_reference(ckpt: Path, prompt: np.ndarray, n_new: int) -> dict[str, np.ndarray]:
    """transformers (float32, eager attention, eager experts): teacher-forced logits [T, V]
    over the prompt, and a greedy continuation of n_new tokens with each step's top-2 gap; for
    DSA models also the smallest indexer top-k boundary gap (`IndexGaps`) over the whole run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Mxfp4Config

    cfg = json.loads((ckpt / "config.json").read_text())
    wrapper = cfg.get("model_type") == "kimi_k25"
    auto = AutoModelForImageTextToText if wrapper else AutoModelForCausalLM
    mx = (cfg.get("quantization_config") or {}).get("quant_method")
    kw = {"quantization_config": Mxfp4Config(dequantize=True)} if mx == "mxfp4" else {}
    model, info = auto.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True, **kw,
    )
    _check_loaded(ckpt, model, info)
    model.eval()
    index = IndexGaps(model)
    with torch.no_grad():
        ids = torch.tensor(prompt[None, :], dtype=torch.long)
        out = model(input_ids=ids, use_cache=True)
        logits = out.logits[0].float().numpy().copy()  # [T, V]
        cache = out.cache
        nxt = out.logits[0, -1]
        tokens, gaps = [], []
        for _ in range(n_new):
            top2 = torch.topk(nxt, 2).values
            gaps.append(float(top2[0] - top2[1]))
            tok = int(torch.argmax(nxt))
            tokens.append(tok)
            out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache = out.cache
            nxt = out.logits[0, -1]
    return {
        "logits": logits.astype(np.float32),
        "greedy": np.asarray(tokens, dtype=np.int64),
        "greedy_gap": np.asarray(gaps, dtype=np.float32),
        "index_gap": np.float32(index.smallest),
    }


def hf_mtp_reference(ckpt: Path, prompt: np.ndarray) -> dict[str, np.ndarray]:
    """transformers' MtpModel on the checkpoint's MTP layer 0, teacher-forced: the main model's
    final-normed hidden states of prompt[:-1] with the tokens prompt[1:] (positions 1..T-1) give
    draft logits [T-1, V], row j predicting prompt[j + 2].

    Two things transformers 5.24 cannot do alone are set up here, nothing in its math changed:
    `MtpModel.from_pretrained` finds MTP weights through the main model's
    `_keys_to_ignore_on_load_unexpected`, which names only the real checkpoints' MTP layer (61, 78),
    so it is pointed at this checkpoint's; and for the DSA families (whose configs have no
    num_mtp_layers) the MTP config gets `num_mtp_layers`, `mtp_layer_types` ("indexed_attention":
    an MTP cache with an indexer key cache) and `mtp_mlp_layer_types`, the masks of that layer type
    are handed to the layer as its attention mask (`create_masks_for_mtp_layer` knows no
    "indexed_attention"), and GLM-5's decoder block, which returns (hidden, top-k), is unwrapped."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import MtpCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpModel

    model, info = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )
    _check_loaded(ckpt, model, info)
    model.eval()
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    dsa = cfg.model_type in DSA_ARCHS
    if dsa:
        cfg.num_mtp_layers = 1
        cfg.mtp_layer_types = ["indexed_attention"]
        cfg.mtp_mlp_layer_types = ["sparse"]
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]

    mtp = MtpModel.from_pretrained(model, device_map={"": torch.device("cpu")})
    mtp.eval()
    if dsa:
        def masks(layer_idx: int, inputs_embeds: Any, mtp_cache: Any, position_ids: Any) -> dict[str, Any]:
            mask = create_causal_mask(config=mtp.config, inputs_embeds=inputs_embeds, attention_mask=None,
                                      cache=mtp_cache, position_ids=position_ids, layer_idx=layer_idx,
                                      allow_is_causal_skip=False)
            return {"attention_mask": mask}

        mtp.create_masks_for_mtp_layer = masks
    if cfg.model_type == "glm_moe_dsa":
        block = mtp.layers[0].mtp_block

        class Unwrap(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = block

            def forward(self, *a: Any, **kw: Any) -> Any:
                return self.inner(*a, **kw)[0]

        mtp.layers[0].mtp_block = Unwrap()
    with torch.no_grad():
        ids = torch.tensor(prompt[None, :], dtype=torch.long)
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # [1, T, D] final-normed (transformers ties it to last_hidden_state)
        cache = MtpCache(config=model.config.get_mtp_config())
        t = len(prompt)
        pos = torch.arange(1, t, dtype=torch.long)[None, :]
        h = mtp.forward_layer(0, hidden[:, : t - 1], pos, cache, input_ids=ids[:, 1:])
        draft = mtp._project_to_logits(h)[0].float().numpy().copy()  # [T-1, V]
    return {"draft_logits": draft.astype(np.float32)}
