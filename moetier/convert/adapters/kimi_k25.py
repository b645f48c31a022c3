"""Kimi K2.5 (kimi_k25): a multimodal wrapper whose text model is DeepSeek-V3 (`text_config`,
model_type kimi_k2, which transformers reads as deepseek_v3): MLA, a sigmoid router with its
correction bias and groups, shared experts. moetier serves the text model; the vision tower
and its projector are skipped and reported by `moetier inspect`, image inputs are refused by
the gateway. Names, in either form of the checkpoint:
  * Moonshot's release: language_model.model.*, language_model.lm_head.weight,
    vision_tower.*, mm_projector.*;
  * transformers 5.24's (`Kimi_K25ForConditionalGeneration.save_pretrained`):
    model.language_model.*, lm_head.weight, model.vision_tower.*, model.mm_projector.*.
Its tokenizer ships as tiktoken.model: the converter writes the equivalent tokenizer.json
(moetier/convert/tiktoken.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from moetier.model.config import ModelArgs

from .base import Adapter, AdapterError, Target
from .deepseek_v3 import DeepseekV3, mla_args, sigmoid_router

_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def kimi_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise AdapterError("kimi_k25: config.json has no text_config (the DeepSeek-V3 text model's config)")
    if text.get("model_type", "kimi_k2") not in ("kimi_k2", "deepseek_v3"):
        raise AdapterError(f"kimi_k25: text_config model_type {text.get('model_type')!r} is not supported "
                           "(expected kimi_k2 / deepseek_v3)")
    # the wrapper's tie_word_embeddings governs, as in transformers (whose default is True)
    return {**text, "model_type": "kimi_k25", "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


class KimiK25(Adapter):
    model_type: ClassVar[str] = "kimi_k25"
    patterns: ClassVar[list[tuple[str, str]]] = DeepseekV3.patterns
    has_mtp: ClassVar[bool] = True  # the text config's num_nextn_predict_layers (0 in the release)
    expert_prefix: ClassVar[str] = "model.language_model.layers.{i}.mlp.experts.{e}.{p}.weight"

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        text = kimi_text_config(cfg)
        for where in (cfg, text):
            method = (where.get("quantization_config") or {}).get("quant_method")
            if method == "compressed-tensors":
                raise AdapterError("kimi_k25: compressed-tensors (packed int4) checkpoints are not read; "
                                   "convert a BF16 or block-FP8 checkpoint")
        return mla_args(text, **sigmoid_router(text))

    def mtp_layers(self, cfg: dict[str, Any]) -> int:
        return super().mtp_layers(kimi_text_config(cfg))

    def skipped(self, name: str) -> str | None:
        return "vision" if name.startswith(VISION_PREFIXES) else None

    def target(self, name: str, args: ModelArgs, mtp_layers: int = 0) -> Target | None:
        if self.skipped(name):
            return None
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super().target(name, args, mtp_layers)

    # written in transformers 5.24's layout (synth)
    def source_name(self, canonical: str) -> str:
        name = super().source_name(canonical)
        return name if name.startswith("lm_head.") else "model.language_model." + name.removeprefix("model.")

    def fused_source_name(self, layer: int, part: Literal["gate_up", "down"]) -> str:
        return f"model.language_model.layers.{layer}.mlp.experts.{part}_proj"
