"""Random checkpoints of named shapes (`moetier synth`).

Every preset is a Hugging Face config.json (transformers 5 style) for one of the adapter
architectures; its `ModelArgs` come from the adapter, like a real checkpoint's. Weights are
drawn per tensor from a numpy Generator keyed by (seed, canonical name), so any tensor can
be regenerated alone (`inspect` does, to measure quantization error) and the output does
not depend on generation order or parallelism.

Initialisation keeps activations in a sane range through every layer: matrices
N(0, 1/fan_in) (output projections a further 1/sqrt(2) so the residual stream grows
slowly), norms one, router rows N(0, 1/D) so routing logits have unit spread (routing is
spread over experts, not degenerate), correction bias N(0, 0.01^2), biases N(0, 0.02^2).

Two output formats: `write_hf_checkpoint` (safetensors with per-expert 2-D names via the
adapter's inverse naming, loadable by transformers) and `write_container` (the moetier
container, generated directly and streaming: each expert is generated, quantized and
written, never a float copy of all experts).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
from tqdm import tqdm

from moetier.convert.adapters import adapter_for
from moetier.convert.adapters.base import iter_expert_parts
from moetier.convert.tokenizer import BOS_ID, STOP_IDS, tokenizer_files
from moetier.errors import InvalidArgument
from moetier.model.config import ModelArgs
from moetier.weights.format import EXPERTS_DIR, MTP_EXPERTS_DIR, expert_file_name, xxh3_hex
from moetier.weights.layout import bias_tensor, model_layout, pack_part_into
from moetier.weights.quant import QDType, bf16_bits, quantize
from moetier.weights.safetensors_io import SafetensorsWriter
from moetier.weights.schema import dense_shapes, expert_shapes, mtp_shapes, tensor_class
from moetier.weights.writer import ContainerWriter

F32 = npt.NDArray[np.float32]
HF_MAX_BYTES = 16 << 30  # a preset whose bf16 HF checkpoint is larger is container-only
DENSE_FILE_BYTES = 256 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict[str, Any]  # Hugging Face config.json (transformers 5 style)
    tokenizer_vocab: int  # target size of the project tokenizer shipped with it
    materialize: bool = True  # False: shape only (planners), synth refuses to write it
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def args(self) -> ModelArgs:
        return adapter_for(self.config["model_type"]).model_args(self.config)

    @property
    def mtp_layers(self) -> int:
        """MTP layers of the preset (its config's num_nextn_predict_layers)."""
        return adapter_for(self.config["model_type"]).mtp_layers(self.config)


_ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "kimi_k25": "Kimi_K25ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
}


def _config(model_type: str, **kw: Any) -> dict[str, Any]:
    rope = kw.pop("rope_parameters", None) or {"rope_theta": kw.pop("rope_theta", 10000.0), "rope_type": "default"}
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": list(STOP_IDS),
        "dtype": "bfloat16",
        "rope_parameters": rope,
    }
    cfg.update(kw)
    return cfg


def _mla(model_type: str, *, hidden: int, layers: int, first_dense: int, experts: int, top_k: int,
         shared: int, moe_i: int, inter: int, heads: int, q_lora: int | None, kv_lora: int, nope: int,
         rope: int, v: int, vocab: int, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, first_k_dense_replace=first_dense,
                n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=shared,
                moe_intermediate_size=moe_i, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=v, attention_bias=False, rope_interleave=True)
    if model_type == "deepseek_v3":
        base.update(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                    num_nextn_predict_layers=1)
    elif model_type in ("deepseek_v32", "glm_moe_dsa"):
        del base["rope_interleave"]  # always interleaved in the main attention: no such config field
        base.update(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                    num_nextn_predict_layers=1)
    else:
        base.update(topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
                    routed_scaling_factor=1.0)
    base.update(kw)
    return _config(model_type, **base)


TINY_VOCAB = 512
# The demo model's context: coding agents' requests carry 10-30k tokens of system prompt and
# tool definitions and ask for up to 32k tokens of answer (Claude Code's default max_tokens);
# the KV cache grows with use, so the length costs nothing until it is used.
DEMO_POSITIONS = 65536


def _tiny() -> dict[str, Preset]:
    gqa = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts_per_tok=2)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfgs = {
        "deepseek_v3": _mla("deepseek_v3", hidden=64, layers=3, first_dense=1, experts=8, top_k=2, shared=1,
                            moe_i=32, inter=128, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
                            vocab=TINY_VOCAB, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            rope_parameters=yarn),
        "deepseek_v2": _mla("deepseek_v2", hidden=64, layers=3, first_dense=1, experts=8, top_k=2, shared=2,
                            moe_i=32, inter=128, heads=4, q_lora=None, kv_lora=32, nope=16, rope=8, v=16,
                            vocab=TINY_VOCAB),
        "glm4_moe": _config("glm4_moe", **gqa, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                            n_shared_experts=1, moe_intermediate_size=32, intermediate_size=128,
                            use_qk_norm=True, attention_bias=True, n_group=1, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=2.5, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
                            rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                             "partial_rotary_factor": 0.5}),
        "qwen3_moe": _config("qwen3_moe", **gqa, num_hidden_layers=2, num_experts=8, moe_intermediate_size=48,
                             intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                             attention_bias=False, use_sliding_window=False, sliding_window=None),
        "qwen2_moe": _config("qwen2_moe", **gqa, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, intermediate_size=128, decoder_sparse_step=1,
                             mlp_only_layers=[], norm_topk_prob=False, qkv_bias=True, use_sliding_window=False,
                             sliding_window=None, max_window_layers=2),
        "mixtral": _config("mixtral", **{**gqa, "head_dim": None}, num_hidden_layers=2, num_local_experts=8,
                           intermediate_size=64, rms_norm_eps=1e-5, sliding_window=None, router_jitter_noise=0.0),
        "olmoe": _config("olmoe", **{k: v for k, v in gqa.items() if k != "head_dim"}, num_hidden_layers=2, num_experts=8,
                         intermediate_size=64, rms_norm_eps=1e-5, clip_qkv=None, norm_topk_prob=False,
                         attention_bias=False),
        # index_topk well under the fixtures' prompts (24 tokens), so the sparse choice really drops
        # positions; full and shared indexer layers both present (GLM-5). 16 index heads: with fewer,
        # relu leaves many exact-zero scores, whose order among ties no implementation defines
        "glm_moe_dsa": _mla("glm_moe_dsa", hidden=64, layers=4, first_dense=1, experts=8, top_k=2, shared=1,
                            moe_i=32, inter=128, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
                            vocab=TINY_VOCAB, routed_scaling_factor=2.5, rms_norm_eps=1e-5, index_topk=8,
                            index_n_heads=16, index_head_dim=32, indexer_types=["full", "shared", "full", "shared"],
                            mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
        "deepseek_v32": _mla("deepseek_v32", hidden=64, layers=3, first_dense=1, experts=8, top_k=2, shared=1,
                             moe_i=32, inter=128, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
                             vocab=TINY_VOCAB, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                             rope_parameters=yarn, index_topk=12, index_n_heads=16, index_head_dim=32),
        # whole-projection q/k norm, a quarter of each head rotated (as MiniMax-M2's 64 of 128: half)
        "minimax_m2": _config("minimax_m2", **gqa, num_hidden_layers=2, num_local_experts=8, intermediate_size=32,
                              rms_norm_eps=1e-6, router_jitter_noise=0.0,
                              rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                               "partial_rotary_factor": 0.5}),
        # three Gated DeltaNet layers then gated full attention (Qwen3-Next's 3:1), two value heads
        # per key head, a quarter of each attention head rotated, a shared expert with its gate
        "qwen3_next": _config("qwen3_next", **_hybrid(), decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True, intermediate_size=128),
        # Qwen3.5-MoE's text model (qwen3_5_moe_text; the multimodal wrapper converts to the same)
        "qwen3_5_moe": _config("qwen3_5_moe_text", **_hybrid()),
        # Kimi K2.5: the wrapper, its text model DeepSeek-V3 (kimi_k2), a small vision tower config
        # (the weights of which the checkpoint does not hold: moetier skips them)
        "kimi_k25": _kimi(_mla("deepseek_v3", hidden=64, layers=3, first_dense=1, experts=8, top_k=2, shared=1,
                               moe_i=32, inter=128, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
                               vocab=TINY_VOCAB, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               num_nextn_predict_layers=0)),
        # sliding and full layers alternating, a window well under the fixtures' prompts and
        # continuations (24 + 32 positions), so the window drops positions and the KV cache slides;
        # YaRN as gpt-oss has it (truncate false, mscale from the factor)
        "gpt_oss": _config("gpt_oss", **gqa, num_hidden_layers=4, num_local_experts=8, intermediate_size=32,
                           rms_norm_eps=1e-5, sliding_window=8, attention_bias=True, swiglu_limit=7.0,
                           layer_types=["sliding_attention", "full_attention"] * 2, router_aux_loss_coef=0.0,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 256}),
    }
    return {f"tiny-{k}": Preset(f"tiny-{k}", f"test-sized {k}", v, TINY_VOCAB, tags=("tiny",)) for k, v in cfgs.items()}


def _kimi(text: dict[str, Any]) -> dict[str, Any]:
    """A kimi_k25 wrapper config around a DeepSeek-V3 text config."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    text["model_type"] = "kimi_k2"
    return {"architectures": [_ARCHITECTURES["kimi_k25"]], "model_type": "kimi_k25", "text_config": text,
            "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "num_attention_heads": 2,
                              "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                              "pos_emb_height": 8, "pos_emb_width": 8},
            "projection_hidden_size": 32, "tie_word_embeddings": False, "bos_token_id": BOS_ID,
            "eos_token_id": list(STOP_IDS), "dtype": "bfloat16"}


def _hybrid() -> dict[str, Any]:
    """The tiny shape of the hybrid linear-attention families."""
    return dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, attention_bias=False, linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25})


def _presets() -> dict[str, Preset]:
    p = _tiny()
    p["demo"] = Preset(
        "demo", "the embedded default of `moetier up`: MLA deepseek_v3-style, ~180 MB of int4 experts",
        _mla("deepseek_v3", hidden=512, layers=10, first_dense=1, experts=64, top_k=4, shared=1, moe_i=384,
             inter=1536, heads=8, q_lora=192, kv_lora=128, nope=48, rope=16, v=48, vocab=4096,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=DEMO_POSITIONS),
        4096)
    p["olmoe-1b-7b"] = Preset(
        "olmoe-1b-7b", "the shape of OLMoE-1B-7B (16 layers, 64 experts top-8)",
        _config("olmoe", vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, intermediate_size=1024,
                rms_norm_eps=1e-5, clip_qkv=None, norm_topk_prob=False, attention_bias=False,
                max_position_embeddings=4096),
        4096)
    p["mini-glm"] = Preset(
        "mini-glm", "DeepSeek-V2-Lite-sized MLA with a sigmoid router (~7.6 GB of int4 experts)",
        _mla("deepseek_v3", hidden=2048, layers=27, first_dense=1, experts=64, top_k=6, shared=2, moe_i=1408,
             inter=10944, heads=16, q_lora=None, kv_lora=512, nope=128, rope=64, v=128, vocab=102400,
             routed_scaling_factor=1.0, max_position_embeddings=4096),
        4096)
    p["glm-5"] = Preset(
        "glm-5", "GLM-5's shape (glm_moe_dsa, transformers' defaults: 744B parameters), for planners only",
        _mla("glm_moe_dsa", hidden=6144, layers=78, first_dense=3, experts=256, top_k=8, shared=1, moe_i=2048,
             inter=12288, heads=64, q_lora=2048, kv_lora=512, nope=192, rope=64, v=256, vocab=154880,
             routed_scaling_factor=2.5, rms_norm_eps=1e-5, max_position_embeddings=202752, index_topk=2048,
             index_n_heads=32, index_head_dim=128, num_nextn_predict_layers=1),
        4096, materialize=False)
    return p


PRESETS: dict[str, Preset] = _presets()


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise InvalidArgument(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_args(name: str) -> ModelArgs:
    return preset(name).args


def expert_record_bytes(args: ModelArgs, experts: QDType = "int4", group_size: int = 64) -> int:
    return model_layout(args, experts, group_size).record_bytes


def total_expert_bytes(args: ModelArgs, experts: QDType = "int4", group_size: int = 64) -> int:
    return len(args.moe_layer_ids) * args.n_routed_experts * expert_record_bytes(args, experts, group_size)


def _refuse_shape_only(p: Preset) -> None:
    if not p.materialize:
        gb = total_expert_bytes(p.args) / 1e9
        raise InvalidArgument(f"preset {p.name!r} is shape-only: its int4 experts alone would take {gb:,.0f} GB; "
                              "synth does not materialise it (its ModelArgs are available to planners)")


# ---- weights ---------------------------------------------------------------------------------
def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, xxhash.xxh3_64_intdigest(key.encode())])


def _std(name: str, shape: tuple[int, ...], d: int) -> float:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("router", "shared_gate", "lm_head"):
        return 1.0 / np.sqrt(d)
    if leaf == "embed":
        return 1.0
    if leaf == "router_bias":
        return 0.01
    if leaf == "sinks":  # gpt-oss: learned logits of the size of the attention scores
        return 1.0
    if leaf in ("router_logit_bias", "gate_bias", "up_bias", "down_bias", "bo"):
        return 0.1
    if leaf in ("bq", "bk", "bv", "index_k_bias"):
        return 0.02
    std = 1.0 / np.sqrt(shape[-1])
    if leaf in ("wo", "w_down", "down"):
        std /= np.sqrt(2.0)
    return float(std)


# A purely random readout gives near-uniform next-token distributions (median top-2 logit gap
# ~0.2 over 512 tokens), unlike trained models, whose predictions are confident. The synth
# readout adds, to each lm_head row v, the embedding of a fixed random token pi(v) scaled by
# READOUT_ALIGNMENT / sqrt(D): the residual stream carries the input token's embedding, so the
# model behaves like a confident bigram model (median gap several nats) while every layer still
# shapes the logits. Quantization studies on synth models are then not dominated by near-ties.
READOUT_ALIGNMENT = 4.0
# An MTP layer drafts the token the main model will choose next. A random one would agree with it
# by chance only; the synth MTP layer instead passes the normed embedding of its input token
# through eh_proj (its embedding half is MTP_ALIGNMENT times the identity, over a small random
# matrix), so its readout sees what the main model's does: the input token's embedding, shaped by
# one decoder block, and it agrees with the main model as often as a trained MTP head does.
MTP_ALIGNMENT = 1.0
MTP_EH_NOISE = 0.25  # std of eh_proj's random part, times 1/sqrt(2D)
# Version of the weight generator, recorded in synth manifests: inspect regenerates source
# tensors only for containers made by this version (2: the confident readout above). The MTP
# layers added no new version: every tensor generator 2 made is made the same.
GENERATOR_VERSION = 2


def dense_tensor(name: str, shape: tuple[int, ...], seed: int, hidden: int) -> F32:
    """The float32 source of a dense tensor of a synth model."""
    if "norm" in name.rsplit(".", 1)[-1]:  # (index_k_bias is no norm: its leaf says bias)
        return np.ones(shape, dtype=np.float32)
    x = _rng(seed, name).standard_normal(shape, dtype=np.float32)
    x *= np.float32(_std(name, shape, hidden))
    if name.startswith("mtp.") and name.endswith(".eh_proj"):  # [D, 2D]: [embedding | hidden] -> D
        x *= np.float32(MTP_EH_NOISE)
        x[:, : shape[0]] += np.float32(MTP_ALIGNMENT) * np.eye(shape[0], dtype=np.float32)
    if name == "lm_head":
        embed = dense_tensor("embed", shape, seed, hidden)  # [V, D], same shape as lm_head
        perm = _rng(seed, "readout").permutation(shape[0])
        x += embed[perm] * np.float32(READOUT_ALIGNMENT / np.sqrt(hidden))
    return x


def expert_tensor(layer: int, expert: int, part: str, shape: tuple[int, ...], seed: int) -> F32:
    """The float32 source of one routed expert matrix (or bias: gpt-oss) of a synth model."""
    x = _rng(seed, f"layers.{layer}.experts.{expert}.{part}").standard_normal(shape, dtype=np.float32)
    x *= np.float32(_std(part, shape, shape[-1]))
    return x


def expert_part_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every part of a routed expert: gate, up, down, and gpt-oss's biases."""
    ex = dict(expert_shapes(args))
    if args.expert_bias:
        i, d = args.moe_intermediate_size, args.hidden_size
        ex.update(gate_bias=(i,), up_bias=(i,), down_bias=(d,))
    return ex


def _gpt_oss_expert(layer: int, e: int, ex: dict[str, tuple[int, ...]], seed: int, mxfp4: bool) -> dict[str, Any]:
    """One gpt-oss expert's parts as the container stores them: mxfp4 QTensors (from the float
    source, quantized once: an MXFP4 synth source is those bytes) or float32."""
    out: dict[str, Any] = {}
    for part, shape in ex.items():
        x = expert_tensor(layer, e, part, shape, seed)
        out[part] = quantize(x, "mxfp4") if mxfp4 and not part.endswith("_bias") else x
    return out


def _gpt_oss_fused(layer: int, e_count: int, ex: dict[str, tuple[int, ...]], what: str, seed: int) -> np.ndarray:
    """gpt-oss's fused expert tensors (adapters/gpt_oss.py): gate and up interleaved, dense
    matrices transposed; `*_blocks`/`*_scales`: the MXFP4 form."""
    mx = what.endswith(("_blocks", "_scales"))
    parts = [_gpt_oss_expert(layer, e, ex, seed, mx) for e in range(e_count)]
    out: list[np.ndarray] = []
    for p in parts:
        if what == "gate_up_proj_bias":
            b = np.empty(2 * len(p["gate_bias"]), dtype=np.float32)
            b[0::2], b[1::2] = p["gate_bias"], p["up_bias"]
            out.append(b)
        elif what == "down_proj_bias":
            out.append(p["down_bias"])
        elif what == "gate_up_proj":  # [D, 2I]
            m = np.empty((p["gate"].shape[1], 2 * p["gate"].shape[0]), dtype=np.float32)
            m[:, 0::2], m[:, 1::2] = p["gate"].T, p["up"].T
            out.append(m)
        elif what == "down_proj":  # [I, D]
            out.append(np.ascontiguousarray(p["down"].T))
        else:  # MXFP4: rows are the outputs (2I interleaved, or D), [rows, C/32, 16] and [rows, C/32]
            g, u, d = p["gate"], p["up"], p["down"]
            if what.startswith("gate_up"):
                rows = np.empty((2 * g.shape[0], *g.data.shape[1:]), dtype=np.uint8)
                sc = np.empty((2 * g.shape[0], g.scales.shape[1]), dtype=np.uint8)
                rows[0::2], rows[1::2], sc[0::2], sc[1::2] = g.data, u.data, g.scales, u.scales
            else:
                rows, sc = d.data, d.scales
            out.append(rows.reshape(rows.shape[0], -1, 16) if what.endswith("_blocks") else sc)
    return np.stack(out)


def gpt_oss_expert_tensors(args: ModelArgs, layer: int, mxfp4: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(source name, shape, what) of one gpt-oss layer's fused expert tensors."""
    e, i, d = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    p = f"model.layers.{layer}.mlp.experts."
    if mxfp4:
        mats = [(p + "gate_up_proj_blocks", (e, 2 * i, -(-d // 32), 16), "gate_up_proj_blocks"),
                (p + "gate_up_proj_scales", (e, 2 * i, -(-d // 32)), "gate_up_proj_scales"),
                (p + "down_proj_blocks", (e, d, -(-i // 32), 16), "down_proj_blocks"),
                (p + "down_proj_scales", (e, d, -(-i // 32)), "down_proj_scales")]
    else:
        mats = [(p + "gate_up_proj", (e, d, 2 * i), "gate_up_proj"), (p + "down_proj", (e, i, d), "down_proj")]
    return [*mats, (p + "gate_up_proj_bias", (e, 2 * i), "gate_up_proj_bias"),
            (p + "down_proj_bias", (e, d), "down_proj_bias")]


# ---- Hugging Face format ----------------------------------------------------------------------
_HF_TAG = {"bf16": "BF16", "f32": "F32", "f16": "F16"}


Gen = Callable[[int], F32]


def _fused_gate_up(layer: int, e_count: int, ex: dict[str, tuple[int, ...]], seed: int) -> F32:
    return np.stack([np.concatenate([expert_tensor(layer, e, "gate", ex["gate"], seed),
                                     expert_tensor(layer, e, "up", ex["up"], seed)]) for e in range(e_count)])


def _fused_down(layer: int, e_count: int, ex: dict[str, tuple[int, ...]], seed: int) -> F32:
    return np.stack([expert_tensor(layer, e, "down", ex["down"], seed) for e in range(e_count)])


def _dense_gen(name: str, shape: tuple[int, ...], hidden: int, seed: int) -> F32:
    return dense_tensor(name, shape, seed, hidden)


def _source_gen(src: str, parts: tuple[str, ...], preset: str, hidden: int, seed: int) -> F32:
    """A source tensor of the HF layout, from the canonical tensors it is made of."""
    p = PRESETS[preset]
    args = p.args
    shapes = dense_shapes(args)
    return adapter_for(p.config["model_type"]).to_source(
        src, {n: dense_tensor(n, shapes[n], seed, hidden) for n in parts}, args)


def _expert_gen(layer: int, e: int, part: str, shape: tuple[int, ...], seed: int) -> F32:
    return expert_tensor(layer, e, part, shape, seed)


def _hf_tensors(p: Preset, fused: bool, mxfp4: bool = False) -> list[tuple[str, tuple[int, ...], Gen]]:
    """(source name, shape, generator(seed)) in checkpoint order."""
    args = p.args
    ad = adapter_for(p.config["model_type"])
    shapes = dense_shapes(args)
    ex = expert_shapes(args)
    d, e_count, inter = args.hidden_size, args.n_routed_experts, args.moe_intermediate_size
    out: list[tuple[str, tuple[int, ...], Gen]] = []

    def dense(*names: str) -> None:
        for src, parts in ad.source_tensors(list(names), args):
            # the source shape, from the adapter's inverse fix over zero-size-in-memory stand-ins
            shape = tuple(ad.to_source(src, {n: np.broadcast_to(np.float32(0), shapes[n]) for n in parts}, args).shape)
            out.append((src, shape, partial(_source_gen, src, tuple(parts), p.name, d)))

    dense("embed")
    for i in range(args.num_layers):
        dense(*(n for n in shapes if n.startswith(f"layers.{i}.")))
        if not args.moe_layers[i]:
            continue
        if args.expert_bias:  # gpt-oss: always fused
            exb = expert_part_shapes(args)
            for name, shape, what in gpt_oss_expert_tensors(args, i, mxfp4):
                out.append((name, shape, partial(_gpt_oss_fused, i, e_count, exb, what)))
            continue
        if fused:
            out.append((ad.fused_source_name(i, "gate_up"), (e_count, 2 * inter, d),
                        partial(_fused_gate_up, i, e_count, ex)))
            out.append((ad.fused_source_name(i, "down"), (e_count, d, inter), partial(_fused_down, i, e_count, ex)))
            continue
        for e in range(e_count):
            for part in ("gate", "up", "down"):
                out.append((ad.expert_source_name(i, e, part), ex[part], partial(_expert_gen, i, e, part, ex[part])))
    dense("final_norm")
    if "lm_head" in shapes:
        dense("lm_head")
    n_mtp = p.mtp_layers
    for n, shape in mtp_shapes(args, n_mtp).items():
        out.append((ad.mtp_source_name(n, args.num_layers), shape, partial(_dense_gen, n, shape, d)))
    for li in range(args.num_layers, args.num_layers + n_mtp):
        for e in range(e_count):
            for part in iter_expert_parts():
                out.append((ad.expert_source_name(li, e, part), ex[part],
                            partial(_expert_gen, li, e, part, ex[part])))
    return out


def _hf_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    if x.dtype == np.uint8:  # MXFP4 blocks and scales, as they are
        return x
    if dtype == "bf16":
        return bf16_bits(x)
    return x.astype(np.float16) if dtype == "f16" else x


def write_hf_checkpoint(preset: str, out_dir: Path, seed: int, *, dtype: str = "bf16",
                        shard_bytes: int = 2 << 30, fused: bool = False, mxfp4: bool = False) -> Path:
    """A Hugging Face checkpoint directory (config, tokenizer, safetensors shards).
    mxfp4: gpt-oss's experts as released, MXFP4 blocks and scales (with the config's
    quantization_config), the other tensors in `dtype`."""
    p = PRESETS[_known(preset)]
    _refuse_shape_only(p)
    if dtype not in _HF_TAG:
        raise InvalidArgument(f"HF dtype {dtype!r} not one of {', '.join(_HF_TAG)}")
    if mxfp4 and not p.args.expert_bias:
        raise InvalidArgument(f"preset {preset!r}: MXFP4 experts are gpt-oss's form (use tiny-gpt_oss)")
    tensors = _hf_tensors(p, fused, mxfp4)
    item = 4 if dtype == "f32" else 2
    total = sum(int(np.prod(s)) * item for _, s, _ in tensors)
    if total > HF_MAX_BYTES:
        raise InvalidArgument(f"preset {preset!r} would be a {total / 1e9:.1f} GB HF checkpoint; "
                              "use --format container, which streams it")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...], Gen]]] = [[]]
    size = 0
    for t in tensors:
        n = int(np.prod(t[1])) * item
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards, strict=True):
        w = SafetensorsWriter(out_dir / fname, [(n, "U8" if n.endswith(("_blocks", "_scales")) else _HF_TAG[dtype], s)
                                                for n, s, _ in shard], {"format": "pt"})
        for tname, _, gen in shard:
            w.write(tname, _hf_cast(gen(seed), dtype))
            weight_map[tname] = fname
        w.close()
    if len(shards) > 1:
        idx = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2) + "\n")
    cfg = dict(p.config, dtype={"bf16": "bfloat16", "f32": "float32", "f16": "float16"}[dtype])
    if mxfp4:  # as gpt-oss's released config says it
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name, data in tokenizer_files(p.tokenizer_vocab, p.args.max_position_embeddings).items():
        (out_dir / name).write_bytes(data)
    return out_dir


def _known(name: str) -> str:
    return preset(name).name


# ---- container format -------------------------------------------------------------------------
def _dense_groups(w: ContainerWriter) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for name, spec in w.dense_specs.items():
        n = sum(int(np.prod(s)) for _, _, s in spec.entries())
        if group and size + n > DENSE_FILE_BYTES:
            yield group
            group, size = [], 0
        group.append(name)
        size += n
    if group:
        yield group


def _synth_layer(job: tuple[Path, str, int, int, QDType, int]) -> list[str]:
    """Generate, quantize and write every expert record of one layer; returns their checksums."""
    out, name, seed, layer, experts, g = job
    args = PRESETS[name].args
    layout = model_layout(args, experts, g)
    shapes = expert_part_shapes(args)
    sums = []
    where = MTP_EXPERTS_DIR if layer >= args.num_layers else EXPERTS_DIR
    fd = os.open(out / where / expert_file_name(layer), os.O_RDWR)
    try:
        buf = bytearray(layout.record_bytes)
        for e in range(args.n_routed_experts):
            buf[:] = bytes(layout.record_bytes)
            for part in layout.part_names:
                x = expert_tensor(layer, e, part, shapes[part], seed)
                q = bias_tensor(x) if part.endswith("_bias") else quantize(x, experts, g)
                pack_part_into(layout.part(part), q, buf, 0)
            os.pwrite(fd, buf, e * layout.record_bytes)
            sums.append(xxh3_hex(buf))
    finally:
        os.close(fd)
    return sums


def write_container(preset: str, out_dir: Path, seed: int, experts: QDType = "int4", dense: QDType = "int8",
                    group_size: int = 64, *, workers: int | None = None, progress: bool = False,
                    mtp: QDType | None = "int8") -> Path:
    """Generate a container directly: dense tensors file by file, experts layer by layer
    (in `workers` processes), each expert generated, quantized and written on its own.
    `mtp`: the dtype of the preset's MTP layers (None: leave them out)."""
    p = PRESETS[_known(preset)]
    _refuse_shape_only(p)
    args = p.args
    n_mtp = p.mtp_layers if mtp is not None else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    w = ContainerWriter(out_dir, args, experts, dense, group_size, mtp_layers=n_mtp, mtp_dtype=mtp or "int8")
    for k, group in enumerate(_dense_groups(w), start=1):
        f = w.dense_file(k, group)
        for name in group:
            spec = w.dense_specs[name]
            x = dense_tensor(name, spec.shape, seed, args.hidden_size)
            f.add(name, quantize(x, spec.dtype, group_size))
        f.close()
    if n_mtp:
        f = w.mtp_dense_file(1, list(w.mtp_specs))
        for name, spec in w.mtp_specs.items():
            f.add(name, quantize(dense_tensor(name, spec.shape, seed, args.hidden_size), spec.dtype, group_size))
        f.close()
    layers = args.moe_layer_ids + w.mtp_layers
    for li in layers:
        w.expert_file(li)  # created and sized here; workers write records into it
    jobs = [(out_dir, preset, seed, li, experts if li < args.num_layers else (mtp or "int8"), group_size)
            for li in layers]
    n_workers = workers if workers is not None else (min(os.cpu_count() or 1, len(jobs))
                                                      if total_expert_bytes(args, experts, group_size) > (64 << 20)
                                                      else 1)
    bar = tqdm(total=len(jobs), unit="layer", desc=f"synth {preset}", disable=not progress)
    if n_workers > 1:
        with mp.get_context("spawn").Pool(n_workers) as pool:
            results = []
            for r in pool.imap(_synth_layer, jobs):
                results.append(r)
                bar.update(1)
    else:
        results = []
        for j in jobs:
            results.append(_synth_layer(j))
            bar.update(1)
    bar.close()
    for li, sums in zip(layers, results, strict=True):
        for e, ck in enumerate(sums):
            w.note_record(li, e, ck)
    cfg = json.dumps(dict(p.config, dtype="bfloat16"), indent=2) + "\n"
    copies: dict[str, bytes | Path] = {"config.json": cfg.encode()}
    copies.update(tokenizer_files(p.tokenizer_vocab, args.max_position_embeddings))
    source = {"kind": "synth", "model_type": p.config["model_type"], "preset": preset, "seed": seed,
              "generator": GENERATOR_VERSION, "files": {}}
    w.finish(source, copies)
    return out_dir


def describe(name: str) -> dict[str, Any]:
    """Size figures of a preset without building it."""
    p = preset(name)
    args = p.args
    return {"preset": name, "arch": args.arch, "layers": args.num_layers, "moe_layers": len(args.moe_layer_ids),
            "experts": args.n_routed_experts, "top_k": args.num_experts_per_tok,
            "record_bytes_int4": expert_record_bytes(args), "expert_bytes_int4": total_expert_bytes(args),
            "dense_params": sum(int(np.prod(s)) for s in dense_shapes(args).values()),
            "materialize": p.materialize, "exact_tensors": sum(
                1 for n, s in dense_shapes(args).items() if tensor_class(n, s) == "exact")}


def shape_report(name: str, experts: QDType = "int4", dense: QDType = "int8", group_size: int = 64,
                 mtp: str = "int8") -> dict[str, Any]:
    """What a preset's container would hold and what must stay resident, without building it:
    bytes of the dense part, of the routed experts and of the MTP head (its dense tensors and its
    experts), in the given dtypes, and the per-token KV cache."""
    from moetier.weights.writer import planned_dense, planned_mtp

    p = preset(name)
    args = p.args

    def nbytes(specs: dict[str, Any]) -> int:
        return sum(int(np.prod(sh)) * (4 if t == "F32" else 2 if t in ("F16", "U16") else 1)
                   for spec in specs.values() for _, t, sh in spec.entries())

    n_mtp = p.mtp_layers if mtp != "none" else 0
    mtp_dtype: QDType = "int8" if mtp in ("none", "int4") else mtp  # type: ignore[assignment]
    mtp_dense = nbytes(planned_mtp(args, n_mtp, mtp_dtype, group_size)) if n_mtp else 0
    mtp_experts = n_mtp * args.n_routed_experts * expert_record_bytes(args, mtp_dtype, group_size)
    dense_b = nbytes(planned_dense(args, dense, group_size))
    return {
        "preset": name, "arch": args.arch, "layers": args.num_layers, "moe_layers": len(args.moe_layer_ids),
        "experts": args.n_routed_experts, "top_k": args.num_experts_per_tok, "mtp_layers": n_mtp,
        "quantization": {"experts": experts, "dense": dense, "group_size": group_size, "mtp": mtp_dtype},
        "dense_bytes": dense_b,
        "expert_bytes": total_expert_bytes(args, experts, group_size),
        "record_bytes": expert_record_bytes(args, experts, group_size),
        "active_expert_bytes_per_token": len(args.moe_layer_ids) * args.num_experts_per_tok
        * expert_record_bytes(args, experts, group_size),
        "mtp_dense_bytes": mtp_dense, "mtp_expert_bytes": mtp_experts,
        "kv_bytes_per_token": 4 * args.kv_floats_per_token,
        "resident_bytes": dense_b + mtp_dense,  # the routed experts (main and MTP) are tiered
    }


def format_shape(r: dict[str, Any]) -> str:
    q = r["quantization"]
    gb = 1e9
    return "\n".join([
        f"preset       {r['preset']} ({r['arch']}): {r['layers']} layers ({r['moe_layers']} MoE), "
        f"{r['experts']} experts top-{r['top_k']}, {r['mtp_layers']} MTP layer(s)",
        f"dense        {r['dense_bytes'] / gb:,.2f} GB ({q['dense']}; norms, routers and gates f32)",
        f"experts      {r['expert_bytes'] / gb:,.2f} GB ({q['experts']} g{q['group_size']}, "
        f"{r['record_bytes']:,} bytes per record; {r['active_expert_bytes_per_token'] / gb:,.2f} GB active per token)",
        f"MTP head     {r['mtp_dense_bytes'] / gb:,.2f} GB dense + {r['mtp_expert_bytes'] / gb:,.2f} GB experts "
        f"({q['mtp']})",
        f"KV cache     {r['kv_bytes_per_token']:,} bytes per token (float32)",
        f"resident     {r['resident_bytes'] / gb:,.2f} GB (dense + the MTP head's dense part; routed experts, "
        "the MTP head's included, live in the expert tier)",
    ])
