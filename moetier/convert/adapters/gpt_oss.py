"""gpt-oss (gpt_oss): GQA attention with biases on q/k/v/o and a learned sink logit per head,
layers alternating sliding-window and full attention (`layer_types`, window `sliding_window`),
rotate-half rope with YaRN; a router with a logit bias that takes the top-k logits and then
their softmax; experts with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit).

Experts come fused per layer, gate and up interleaved (gate rows 0::2, up rows 1::2), in one
of two forms:
  * MXFP4, as released: `gate_up_proj_blocks` uint8 [E, 2I, D/32, 16] with `gate_up_proj_scales`
    uint8 [E, 2I, D/32] (e8m0), `down_proj_blocks` [E, D, I/32, 16] with `down_proj_scales`;
    kept as moetier's mxfp4 (the same bytes: lossless);
  * dense (bf16/f32, as transformers saves a dequantized model): `gate_up_proj` [E, D, 2I],
    `down_proj` [E, I, D] (transposed: inputs first);
and `gate_up_proj_bias` [E, 2I] (interleaved), `down_proj_bias` [E, D]."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import GQA_ATTENTION, Adapter, AdapterError, FusedExperts, Target, require, rope_params
from .qwen_moe import gqa_softmax_args

_ATTN = [
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.o_proj\.bias", "layers.{i}.attn.bo"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.sinks", "layers.{i}.attn.sinks"),
]
_MOE = [
    (r"model\.layers\.(?P<i>\d+)\.mlp\.router\.weight", "layers.{i}.moe.router"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.router\.bias", "layers.{i}.moe.router_logit_bias"),
]
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?")
MXFP4_SCALES = "_scales"  # read with its `_blocks` tensor, from the same shard


class GptOss(Adapter):
    model_type: ClassVar[str] = "gpt_oss"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + _ATTN + _MOE

    def target(self, name: str, args: ModelArgs, mtp_layers: int = 0) -> Target | None:
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return super().target(name, args, mtp_layers)
        layer, proj, suffix = int(m.group(1)), m.group(2), m.group(3) or ""
        if layer >= args.num_layers or suffix == MXFP4_SCALES:
            return None
        part = ("gate_up" if proj == "gate_up_proj" else "down") + ("_bias" if suffix == "_bias" else "")
        return FusedExperts(layer, part, layout="gpt_oss")  # type: ignore[arg-type]

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "num_local_experts", "intermediate_size", "num_attention_heads", "hidden_size",
                "num_hidden_layers")
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise AdapterError(f"gpt_oss: layer_types {types} must give sliding_attention or full_attention "
                               f"for each of the {n} layers")
        window = int(cfg.get("sliding_window") or 0)
        sliding = tuple(t == "sliding_attention" for t in types)
        if any(sliding) and window <= 0:
            raise AdapterError("gpt_oss: sliding_attention layers need a sliding_window > 0")
        rp = rope_params(cfg)
        if "rope_theta" not in (cfg.get("rope_parameters") or {}) and "rope_theta" not in cfg:
            rp["rope_theta"] = 150000.0  # transformers' GptOssConfig default_theta
        bias = bool(cfg.get("attention_bias", True))
        return gqa_softmax_args(
            {**cfg, "rope_parameters": rp, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)},
            qkv_bias=bias,
            o_bias=bias,
            attn_sinks=True,
            sliding_window=window if any(sliding) else 0,
            sliding_layers=sliding if any(sliding) else (),
            moe_layers=(True,) * n,
            n_routed_experts=int(cfg["num_local_experts"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            intermediate_size=0,
            scoring_func="topk_softmax",
            router_logit_bias=True,
            expert_bias=True,
            expert_act="clamped_swiglu",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )

    def source_name(self, canonical: str) -> str:
        if canonical.endswith(".moe.router"):
            return "model.layers.{}.mlp.router.weight".format(canonical.split(".")[1])
        if canonical.endswith(".moe.router_logit_bias"):
            return "model.layers.{}.mlp.router.bias".format(canonical.split(".")[1])
        return super().source_name(canonical)
