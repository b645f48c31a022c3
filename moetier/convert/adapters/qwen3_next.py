"""Qwen3-Next (qwen3_next) and Qwen3.5-MoE (qwen3_5_moe, qwen3_5_moe_text): hybrid layers --
Gated DeltaNet linear attention (`linear_attn.*`) interleaved with gated full attention
(q_proj yields per head [query | gate], per-head q/k norm, partial rotary, a quarter of each
head by default) -- and a softmax MoE with a shared expert scaled by sigmoid(shared_expert_gate).
The math is moetier/model/deltanet.py.

Checkpoint quirks, fixed here at load time (`fix`, inverted by `to_source`):
  * the decoder's RMSNorms (input/post-attention, final, q/k norm) multiply by (1 + weight):
    stored as the plain weight 1 + w (the linear attention's gated norm uses its weight as is);
  * Qwen3-Next fuses in_proj_qkvz and in_proj_ba, grouped by key head ([q, k, v.., z..] rows
    per key head, [b.., a..] likewise): split into the canonical wqkv (q of every key head, then
    k, then v: the convolution's channel order), wz, wb and wa. Qwen3.5 stores them split.
  * conv1d.weight [C, 1, Kc] -> conv [C, Kc].
Qwen3.5-MoE's multimodal checkpoint (`Qwen3_5MoeForConditionalGeneration`) keeps the text model
under model.language_model.* and the config under text_config; its vision tower
(model.visual.*) is skipped and reported by `moetier inspect`. Its rope (mrope over three
position axes) equals plain rotate_half rope for text, whose three position ids are one.
MTP layers (mtp.*) are not served. Every layer of Qwen3.5-MoE is MoE; Qwen3-Next follows
decoder_sparse_step / mlp_only_layers.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs

from .base import (
    DENSE_MLP,
    GQA_ATTENTION,
    MOE_COMMON,
    Adapter,
    AdapterError,
    Target,
    moe_layers_sparse_step,
    require,
)
from .qwen_moe import gqa_softmax_args

F32 = npt.NDArray[np.float32]

_LINEAR = [
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_qkv\.weight", "layers.{i}.linear.wqkv"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_z\.weight", "layers.{i}.linear.wz"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_b\.weight", "layers.{i}.linear.wb"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_a\.weight", "layers.{i}.linear.wa"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_qkvz\.weight", "layers.{i}.linear.in_proj_qkvz"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.in_proj_ba\.weight", "layers.{i}.linear.in_proj_ba"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.conv1d\.weight", "layers.{i}.linear.conv"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.A_log", "layers.{i}.linear.a_log"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.dt_bias", "layers.{i}.linear.dt_bias"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.norm\.weight", "layers.{i}.linear.norm"),
    (r"model\.layers\.(?P<i>\d+)\.linear_attn\.out_proj\.weight", "layers.{i}.linear.wo"),
]
# the (1 + w) RMSNorms
_OFFSET_NORM = re.compile(r"(layers\.\d+\.(attn_norm|ffn_norm|attn\.q_norm|attn\.k_norm)|final_norm)")
_FUSED = re.compile(r"layers\.(\d+)\.linear\.(in_proj_qkvz|in_proj_ba)")
_TEXT_PREFIX = "model.language_model."
# tensors of the multimodal checkpoint the text model does not use (reported as skipped)
VISION_PREFIXES = ("model.visual.", "visual.")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: text_config of a multimodal checkpoint (with the wrapper's
    tie_word_embeddings, which governs in transformers), else the config itself."""
    if not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = dict(cfg["text_config"])
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """'linear'/'full' per layer, from layer_types or (released configs) full_attention_interval."""
    n = int(cfg["num_hidden_layers"])
    names = cfg.get("layer_types")
    if names is None:
        every = int(cfg.get("full_attention_interval") or 4)
        names = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    kinds = {"linear_attention": "linear", "full_attention": "full"}
    if len(names) != n or any(t not in kinds for t in names):
        raise AdapterError(f"layer_types {names!r}: need {n} entries of linear_attention / full_attention")
    return tuple(kinds[t] for t in names)


class HybridAdapter(Adapter):
    """What both families share; writes the split layout (Qwen3.5's) and reads either."""

    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + _LINEAR + DENSE_MLP + MOE_COMMON
    all_moe: ClassVar[bool] = False  # Qwen3.5: every layer is MoE

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        cfg = {**text_config(cfg), "model_type": self.model_type}
        require(cfg, "moe_intermediate_size", "num_experts", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
        if cfg.get("hidden_act", "silu") != "silu":
            raise AdapterError(f"{self.model_type}: hidden_act {cfg['hidden_act']!r} is not supported (expected silu)")
        n_exp = int(cfg["num_experts"])
        rp = dict(cfg.get("rope_parameters") or {})
        rp.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        for k in ("mrope_section", "mrope_interleaved"):  # text positions: the same as plain rope
            rp.pop(k, None)
        moe = ((bool(n_exp),) * int(cfg["num_hidden_layers"]) if self.all_moe
               else moe_layers_sparse_step(cfg, n_exp))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return gqa_softmax_args(
            {**cfg, "rope_parameters": rp},
            qk_norm="head",
            qkv_bias=bool(cfg.get("attention_bias", False)),
            moe_layers=moe,
            n_routed_experts=n_exp,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_intermediate_size=shared,
            shared_expert_gate=shared > 0,
            norm_topk_prob=True if self.all_moe else bool(cfg.get("norm_topk_prob", True)),
            layer_types=layer_types(cfg),
            linear_num_key_heads=int(cfg["linear_num_key_heads"]),
            linear_num_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            linear_conv_kernel=int(cfg["linear_conv_kernel_dim"]),
            attn_output_gate=True,
        )

    def skipped(self, name: str) -> str | None:
        """Why a source tensor is not converted ("vision", "mtp"), or None."""
        if name.startswith(VISION_PREFIXES):
            return "vision"
        if name.startswith("mtp."):
            return "mtp"
        return None

    def target(self, name: str, args: ModelArgs, mtp_layers: int = 0) -> Target | None:
        if self.skipped(name):
            return None
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        return super().target(name, args, mtp_layers)

    def fix(self, name: str, x: F32, args: ModelArgs) -> list[tuple[str, F32]]:
        if _OFFSET_NORM.fullmatch(name):
            return [(name, (x + np.float32(1.0)).astype(np.float32))]
        if name.endswith(".linear.conv"):
            return [(name, np.ascontiguousarray(x.reshape(x.shape[0], -1)))]
        m = _FUSED.fullmatch(name)
        if m is None:
            return [(name, x)]
        p = f"layers.{m.group(1)}.linear"
        hk, hv = args.linear_num_key_heads, args.linear_num_value_heads
        dk, dv, r, d = args.linear_key_head_dim, args.linear_value_head_dim, hv // hk, x.shape[-1]
        if m.group(2) == "in_proj_ba":
            g = x.reshape(hk, 2 * r, d)  # per key head [b (r rows), a (r rows)]
            return [(f"{p}.wb", g[:, :r].reshape(hv, d)), (f"{p}.wa", g[:, r:].reshape(hv, d))]
        g = x.reshape(hk, 2 * dk + 2 * r * dv, d)  # per key head [q, k, v (r heads), z (r heads)]
        q, k = g[:, :dk].reshape(-1, d), g[:, dk : 2 * dk].reshape(-1, d)
        v, z = g[:, 2 * dk : 2 * dk + r * dv].reshape(-1, d), g[:, 2 * dk + r * dv :].reshape(-1, d)
        return [(f"{p}.wqkv", np.ascontiguousarray(np.concatenate([q, k, v]))), (f"{p}.wz", np.ascontiguousarray(z))]

    def source_name(self, canonical: str) -> str:
        # the shared MLP in the singular, as Qwen2-MoE spells it
        return super().source_name(canonical).replace(".shared_experts.", ".shared_expert.")

    def to_source(self, source: str, parts: dict[str, F32], args: ModelArgs) -> F32:
        (name, x), = parts.items()
        if _OFFSET_NORM.fullmatch(name):
            return (x - np.float32(1.0)).astype(np.float32)
        if name.endswith(".linear.conv"):
            return np.ascontiguousarray(x[:, None, :])
        return x


class Qwen3Next(HybridAdapter):
    """Qwen3-Next: written in its own layout, in_proj_qkvz and in_proj_ba fused per key head."""

    model_type: ClassVar[str] = "qwen3_next"

    def source_tensors(self, names: list[str], args: ModelArgs) -> list[tuple[str, list[str]]]:
        out: list[tuple[str, list[str]]] = []
        for n in names:
            if n.endswith((".linear.wz", ".linear.wa")):
                continue  # written with wqkv / wb
            i = n.split(".")[1] if n.startswith("layers.") else ""
            if n.endswith(".linear.wqkv"):
                out.append((f"model.layers.{i}.linear_attn.in_proj_qkvz.weight", [n, f"layers.{i}.linear.wz"]))
            elif n.endswith(".linear.wb"):
                out.append((f"model.layers.{i}.linear_attn.in_proj_ba.weight", [n, f"layers.{i}.linear.wa"]))
            else:
                out.append((self.source_name(n), [n]))
        return out

    def to_source(self, source: str, parts: dict[str, F32], args: ModelArgs) -> F32:
        if len(parts) == 1:
            return super().to_source(source, parts, args)
        hk, hv = args.linear_num_key_heads, args.linear_num_value_heads
        dk, dv, r = args.linear_key_head_dim, args.linear_value_head_dim, hv // hk
        if source.endswith("in_proj_ba.weight"):
            wb = parts[next(n for n in parts if n.endswith(".wb"))]
            wa = parts[next(n for n in parts if n.endswith(".wa"))]
            d = wb.shape[-1]
            return np.concatenate([wb.reshape(hk, r, d), wa.reshape(hk, r, d)], axis=1).reshape(-1, d)
        wqkv = parts[next(n for n in parts if n.endswith(".wqkv"))]
        wz = parts[next(n for n in parts if n.endswith(".wz"))]
        d = wqkv.shape[-1]
        q = wqkv[: hk * dk].reshape(hk, dk, d)
        k = wqkv[hk * dk : 2 * hk * dk].reshape(hk, dk, d)
        v = wqkv[2 * hk * dk :].reshape(hk, r * dv, d)
        return np.concatenate([q, k, v, wz.reshape(hk, r * dv, d)], axis=1).reshape(-1, d)


class Qwen35MoeText(HybridAdapter):
    model_type: ClassVar[str] = "qwen3_5_moe_text"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + _LINEAR + MOE_COMMON
    all_moe: ClassVar[bool] = True


class Qwen35Moe(Qwen35MoeText):
    """The multimodal checkpoint: its text model (text_config, model.language_model.*)."""

    model_type: ClassVar[str] = "qwen3_5_moe"
