"""Mixtral: GQA attention, softmax router over all experts, top-k always renormalised;
experts stored as block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any, ClassVar

from moetier.model.config import ModelArgs

from .base import GQA_ATTENTION, Adapter, require
from .qwen_moe import gqa_softmax_args

_MOE = [
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.gate\.weight", "layers.{i}.moe.router"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<p>w1|w2|w3)\.weight", "expert"),
    # transformers 5 in-memory layout, when saved fused
    (r"model\.layers\.(?P<i>\d+)\.(block_sparse_moe|mlp)\.experts\.gate_up_proj(\.weight)?", "fused:gate_up"),
    (r"model\.layers\.(?P<i>\d+)\.(block_sparse_moe|mlp)\.experts\.down_proj(\.weight)?", "fused:down"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.gate\.weight", "layers.{i}.moe.router"),
]


class Mixtral(Adapter):
    model_type: ClassVar[str] = "mixtral"
    patterns: ClassVar[list[tuple[str, str]]] = GQA_ATTENTION + _MOE
    expert_names: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}
    expert_prefix: ClassVar[str] = "model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight"

    def _part(self, p: str) -> Any:
        return {"w1": "gate", "w3": "up", "w2": "down"}[p]

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        require(cfg, "num_local_experts", "intermediate_size")
        n_exp = int(cfg["num_local_experts"])
        return gqa_softmax_args(
            {**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)},
            moe_layers=(True,) * int(cfg["num_hidden_layers"]),
            n_routed_experts=n_exp,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            intermediate_size=0,
            norm_topk_prob=True,  # Mixtral always renormalises the top-k softmax weights
        )

    def source_name(self, canonical: str) -> str:
        if canonical.endswith(".moe.router"):
            return "model.layers.{}.block_sparse_moe.gate.weight".format(canonical.split(".")[1])
        return super().source_name(canonical)
