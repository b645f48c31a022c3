"""Source architectures moetier converts, by Hugging Face `model_type`."""

from __future__ import annotations

from .base import Adapter, AdapterError, Dense, Expert, FusedExperts, Target, UnknownTensor
from .deepseek_v2 import DeepseekV2
from .deepseek_v3 import DeepseekV3
from .dsa import DeepseekV32, GlmMoeDsa
from .glm4_moe import Glm4Moe
from .gpt_oss import GptOss
from .kimi_k25 import KimiK25
from .minimax_m2 import MinimaxM2
from .mixtral import Mixtral
from .olmoe import Olmoe
from .qwen3_next import Qwen3Next, Qwen35Moe, Qwen35MoeText
from .qwen_moe import Qwen2Moe, Qwen3Moe

ADAPTERS: dict[str, type[Adapter]] = {
    a.model_type: a for a in (DeepseekV3, DeepseekV2, Glm4Moe, Qwen3Moe, Qwen2Moe, Mixtral, Olmoe, DeepseekV32,
                              GlmMoeDsa, MinimaxM2, Qwen3Next, Qwen35Moe, Qwen35MoeText, KimiK25,
                              GptOss)
}


def adapter_for(model_type: str | None) -> Adapter:
    if model_type not in ADAPTERS:
        raise AdapterError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]()


__all__ = ["ADAPTERS", "Adapter", "AdapterError", "Dense", "Expert", "FusedExperts", "Target",
           "UnknownTensor", "adapter_for"]
