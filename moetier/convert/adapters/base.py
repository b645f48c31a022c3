"""Adapter contract: one source architecture -> ModelArgs + canonical tensor names.

Canonical names (what the container's dense/ files and the math use):

    embed [V, D]            final_norm [D]          lm_head [V, D] (absent when tied)
    layers.{i}.attn_norm [D]                        layers.{i}.ffn_norm [D]
  GQA attention:
    layers.{i}.attn.wq [H*hd, D]   .wk/.wv [Hkv*hd, D]   .wo [D, H*hd]
    layers.{i}.attn.bq/.bk/.bv     (qkv_bias)
    layers.{i}.attn.q_norm/.k_norm [hd] (qk_norm=head) or [H*hd]/[Hkv*hd] (qk_norm=full)
  MLA attention:
    layers.{i}.attn.wq [H*(nope+rope), D]                       (q_lora_rank is None)
    layers.{i}.attn.wq_a [q_lora, D]  .q_a_norm [q_lora]  .wq_b [H*(nope+rope), q_lora]
    layers.{i}.attn.wkv_a [kv_lora + rope, D]  .kv_a_norm [kv_lora]  .wkv_b [H*(nope+v), kv_lora]
    layers.{i}.attn.wo [D, H*v]
  DSA indexer (layers that run one, ModelArgs.indexer_layers):
    layers.{i}.attn.index_wq_b [Hi*Di, q_lora]  .index_wk [Di, D]  .index_k_norm/.index_k_bias [Di]
    layers.{i}.attn.index_weights [Hi, D]
  Gated attention (attn_output_gate): layers.{i}.attn.wq [2*H*hd, D], per head hd query rows then hd gate rows
  Gated DeltaNet (layers whose layer_types entry is "linear"; C = 2*Hk*dk + Hv*dv):
    layers.{i}.linear.wqkv [C, D] (q of every key head, k, v)  .wz [Hv*dv, D]  .wb/.wa [Hv, D]
    layers.{i}.linear.conv [C, Kc]  .a_log/.dt_bias [Hv]  .norm [dv]  .wo [D, Hv*dv]
  Dense SwiGLU MLP:        layers.{i}.mlp.w_gate/.w_up [F, D]   .w_down [D, F]
  MoE layer:
    layers.{i}.moe.router [E, D]       layers.{i}.moe.router_bias [E] (score correction)
    layers.{i}.moe.shared.w_gate/.w_up [Fs, D]  .w_down [D, Fs]
    layers.{i}.moe.shared_gate [1, D]
  gpt-oss: layers.{i}.attn.bo [D]  .sinks [H]   layers.{i}.moe.router_logit_bias [E]
  Routed experts (expert records, not dense tensors): (layer, expert) -> gate/up [I, D], down [D, I]
    (gpt-oss: and their biases gate_bias/up_bias [I], down_bias [D])
  MTP layers (DeepSeek-V3 style, source layers num_layers + k; moetier/weights/schema.mtp_shapes):
    mtp.{k}.enorm/.hnorm/.head_norm [D]   mtp.{k}.eh_proj [D, 2D]   the decoder block as mtp.{k}.*
    (attn_norm, attn.*, ffn_norm, moe.*), its routed experts as expert layer num_layers + k
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs

F32 = npt.NDArray[np.float32]
ExpertPart = Literal["gate", "up", "down"]


@dataclass(frozen=True)
class Dense:
    """A dense tensor with a canonical name."""

    name: str


@dataclass(frozen=True)
class Expert:
    """One matrix of one routed expert, stored per expert (2-D)."""

    layer: int
    expert: int
    part: ExpertPart


@dataclass(frozen=True)
class FusedExperts:
    """All experts of a layer in one 3-D tensor: gate_up [E, 2I, D] (gate rows first) or down [E, D, I].

    layout "gpt_oss" (moetier/convert/adapters/gpt_oss.py): gate and up interleaved, dense
    matrices transposed (gate_up [E, D, 2I], down [E, I, D]) or MXFP4 blocks with their scales,
    and the biases gate_up_bias [E, 2I], down_bias [E, D]."""

    layer: int
    part: Literal["gate_up", "down", "gate_up_bias", "down_bias"]
    layout: Literal["standard", "gpt_oss"] = "standard"


Target = Dense | Expert | FusedExperts


class UnknownTensor(ValueError):
    pass


class AdapterError(ValueError):
    pass


# Patterns shared by the Llama-family layouts. Each maps a source name to a canonical template;
# {i} is the layer and {e} the expert.
_LLAMA_COMMON: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", "embed"),
    (r"model\.norm\.weight", "final_norm"),
    (r"lm_head\.weight", "lm_head"),
    (r"model\.layers\.(?P<i>\d+)\.input_layernorm\.weight", "layers.{i}.attn_norm"),
    (r"model\.layers\.(?P<i>\d+)\.post_attention_layernorm\.weight", "layers.{i}.ffn_norm"),
]
GQA_ATTENTION: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.(?P<p>[qkvo])_proj\.weight", "layers.{i}.attn.w{p}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.(?P<p>[qkv])_proj\.bias", "layers.{i}.attn.b{p}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.(?P<p>[qk])_norm\.weight", "layers.{i}.attn.{p}_norm"),
]
MLA_ATTENTION: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_proj\.weight", "layers.{i}.attn.wq"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_a_proj\.weight", "layers.{i}.attn.wq_a"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_a_layernorm\.weight", "layers.{i}.attn.q_a_norm"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_b_proj\.weight", "layers.{i}.attn.wq_b"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.kv_a_proj_with_mqa\.weight", "layers.{i}.attn.wkv_a"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.kv_a_layernorm\.weight", "layers.{i}.attn.kv_a_norm"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.kv_b_proj\.weight", "layers.{i}.attn.wkv_b"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.o_proj\.weight", "layers.{i}.attn.wo"),
]
DENSE_MLP: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.mlp\.(?P<p>gate|up|down)_proj\.weight", "layers.{i}.mlp.w_{p}"),
]
MOE_COMMON: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.mlp\.gate\.weight", "layers.{i}.moe.router"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.gate\.e_score_correction_bias", "layers.{i}.moe.router_bias"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_experts?\.(?P<p>gate|up|down)_proj\.weight", "layers.{i}.moe.shared.w_{p}"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert_gate\.weight", "layers.{i}.moe.shared_gate"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<p>gate|up|down)_proj\.weight", "expert"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.gate_up_proj(\.weight)?", "fused:gate_up"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.down_proj(\.weight)?", "fused:down"),
]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Tensors that sources carry and the math never needs.
IGNORED: list[str] = [
    r".*rotary_emb\.inv_freq",
]
# The MTP layers' own tensors (source layer num_layers + k). Their copies of the embedding and the
# lm_head are ignored: transformers' MtpModel shares the main model's, and so does moetier.
MTP_ONLY: list[tuple[str, str]] = [
    (r"model\.layers\.(?P<i>\d+)\.enorm\.weight", "mtp:enorm"),
    (r"model\.layers\.(?P<i>\d+)\.hnorm\.weight", "mtp:hnorm"),
    (r"model\.layers\.(?P<i>\d+)\.eh_proj\.weight", "mtp:eh_proj"),
    (r"model\.layers\.(?P<i>\d+)\.shared_head\.norm\.weight", "mtp:head_norm"),
    (r"model\.layers\.(?P<i>\d+)\.shared_head\.head\.weight", "mtp:-"),
    (r"model\.layers\.(?P<i>\d+)\.embed_tokens\.weight", "mtp:-"),
]
MTP_SOURCE = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
              "head_norm": "shared_head.norm.weight"}


class Adapter:
    """Base class: subclasses set `model_type`, `patterns` and implement `model_args`."""

    model_type: ClassVar[str]
    patterns: ClassVar[list[tuple[str, str]]]
    # expert part names as the source spells them in per-expert 2-D tensors, for writing HF layout
    expert_names: ClassVar[dict[str, str]] = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    expert_prefix: ClassVar[str] = "model.layers.{i}.mlp.experts.{e}.{p}.weight"

    # architectures whose checkpoints may carry MTP layers (num_nextn_predict_layers)
    has_mtp: ClassVar[bool] = False

    def model_args(self, cfg: dict[str, Any]) -> ModelArgs:
        raise NotImplementedError

    def mtp_layers(self, cfg: dict[str, Any]) -> int:
        """MTP layers the checkpoint's config announces (0 for architectures without them)."""
        if not self.has_mtp:
            return 0
        n = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers"))
        return int(n or 0)

    def mtp_hidden_first(self, cfg: dict[str, Any]) -> bool:
        """transformers' mtp_hidden_states_first: eh_proj reads [hidden | embedding]."""
        return bool(cfg.get("mtp_hidden_states_first", False))

    def _compiled(self) -> list[tuple[re.Pattern[str], str]]:
        cache = self.__dict__.get("_re")
        if cache is None:
            extra = MTP_ONLY if self.has_mtp else []
            cache = [(re.compile(p), t) for p, t in _LLAMA_COMMON + self.patterns + extra]
            self.__dict__["_re"] = cache
        return cache

    def target(self, name: str, args: ModelArgs, mtp_layers: int = 0) -> Target | None:
        """Canonical target of a source tensor; None for tensors the math does not use.

        Layers num_layers .. num_layers + mtp_layers - 1 are MTP layers: their dense tensors map
        to `mtp.{k}.*` and their experts keep their layer id; layers past those are not served.
        Raises UnknownTensor for a name this architecture does not define.
        """
        for pat in IGNORED:
            if re.fullmatch(pat, name):
                return None
        for rx, tmpl in self._compiled():
            m = rx.fullmatch(name)
            if not m:
                continue
            g = m.groupdict()
            layer = int(g["i"]) if g.get("i") is not None else None
            mtp = layer is not None and layer >= args.num_layers
            if mtp and (layer is None or layer >= args.num_layers + mtp_layers):
                return None  # MTP layers the conversion does not keep
            if tmpl.startswith("mtp:"):
                if not mtp or layer is None:
                    raise UnknownTensor(f"tensor {name!r} belongs to an MTP layer, but layer {layer} is not one")
                leaf = tmpl[4:]
                return None if leaf == "-" else Dense(f"mtp.{layer - args.num_layers}.{leaf}")
            if tmpl == "expert":
                assert layer is not None
                return Expert(layer, int(g["e"]), self._part(g["p"]))
            if tmpl.startswith("fused:"):
                assert layer is not None
                return FusedExperts(layer, "gate_up" if tmpl.endswith("gate_up") else "down")
            canonical = tmpl.format(**{k: v for k, v in g.items() if v is not None})
            if mtp and layer is not None:
                canonical = canonical.replace(f"layers.{layer}.", f"mtp.{layer - args.num_layers}.", 1)
            return Dense(canonical)
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= args.num_layers:
            return None  # a multi-token-prediction layer's tensor this architecture does not serve
        raise UnknownTensor(f"tensor {name!r} is not part of a {self.model_type} checkpoint")

    def skipped(self, name: str) -> str | None:
        """Why a source tensor of a wrapper checkpoint is left out ("vision", ...), for the
        conversion's report; None for the tensors of the served model."""
        return None

    def fix(self, name: str, x: F32, args: ModelArgs) -> list[tuple[str, F32]]:
        """A dense source tensor (its `target` name) as canonical tensors: where a checkpoint's
        quirks (fused projections, offset norms) are fixed, once, at load time."""
        return [(name, x)]

    def source_tensors(self, names: list[str], args: ModelArgs) -> list[tuple[str, list[str]]]:
        """The source tensors that hold canonical dense tensors `names`: (source name, the
        canonical names it is made of), in order; the inverse of `target` + `fix`."""
        return [(self.source_name(n), [n]) for n in names]

    def to_source(self, source: str, parts: dict[str, F32], args: ModelArgs) -> F32:
        """A source tensor from its canonical parts (see `source_tensors`)."""
        (x,) = parts.values()
        return x

    def _part(self, p: str) -> ExpertPart:
        for part, src in self.expert_names.items():
            if src.startswith(p) or p == part:
                return part  # type: ignore[return-value]
        raise UnknownTensor(f"unknown expert matrix {p!r}")

    # ---- the inverse, for writing Hugging Face layout (synth) -------------------------------
    def source_name(self, canonical: str) -> str:
        """Source-layout name of a canonical dense tensor."""
        for pat, tmpl in _LLAMA_COMMON + self.patterns:
            if tmpl in ("expert",) or tmpl.startswith("fused:"):
                continue
            names = _invert(pat, tmpl, canonical)
            if names is not None:
                return names
        raise KeyError(f"{self.model_type} has no source name for {canonical!r}")

    def mtp_source_name(self, canonical: str, num_layers: int) -> str:
        """Source-layout name of an MTP tensor `mtp.{k}.*` (layer num_layers + k)."""
        m = re.fullmatch(r"mtp\.(\d+)\.(.+)", canonical)
        if m is None:
            raise KeyError(f"{canonical!r} is not an MTP tensor name")
        layer, rest = num_layers + int(m.group(1)), m.group(2)
        if rest in MTP_SOURCE:
            return f"model.layers.{layer}.{MTP_SOURCE[rest]}"
        return self.source_name(f"layers.{layer}.{rest}")

    def expert_source_name(self, layer: int, expert: int, part: ExpertPart) -> str:
        return self.expert_prefix.format(i=layer, e=expert, p=self.expert_names[part])

    def fused_source_name(self, layer: int, part: Literal["gate_up", "down"]) -> str:
        """Source name of a layer's fused expert tensor (transformers 5's in-memory layout)."""
        return f"model.layers.{layer}.mlp.experts.{part}_proj"


def _invert(pattern: str, template: str, canonical: str) -> str | None:
    """Fill a source regex from a canonical name by matching the template."""
    fields = re.findall(r"\{(\w+)\}", template)
    tre = re.escape(template)
    for f in fields:
        tre = tre.replace(re.escape("{" + f + "}"), f"(?P<{f}>[A-Za-z0-9]+)")
    m = re.fullmatch(tre, canonical)
    if not m:
        return None
    values = m.groupdict()
    src = pattern
    for f, v in values.items():
        src = re.sub(r"\(\?P<" + f + r">[^)]*\)", v, src)
    src = re.sub(r"\(\\\.weight\)\?", ".weight", src)
    src = re.sub(r"experts\?", "experts", src)
    if re.search(r"\(\?P<", src):
        return None
    return src.replace("\\.", ".")


def moe_layers_first_k(cfg: dict[str, Any], n_experts: int) -> tuple[bool, ...]:
    """DeepSeek/GLM: layers before first_k_dense_replace are dense."""
    k = int(cfg.get("first_k_dense_replace") or 0)
    return tuple(bool(n_experts) and i >= k for i in range(int(cfg["num_hidden_layers"])))


def moe_layers_sparse_step(cfg: dict[str, Any], n_experts: int) -> tuple[bool, ...]:
    """Qwen-MoE: decoder_sparse_step and mlp_only_layers."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return tuple(
        bool(n_experts) and i not in only and (i + 1) % step == 0 for i in range(int(cfg["num_hidden_layers"]))
    )


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face keeps rope settings in rope_parameters (v5) or rope_theta/rope_scaling (v4)."""
    rp = dict(cfg.get("rope_parameters") or {})
    if not rp:
        rp = dict(cfg.get("rope_scaling") or {})
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
        rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in cfg:
            rp.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    rp.setdefault("rope_type", "default")
    return rp


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(int(x) for x in (e if isinstance(e, list) else [e]))


def require(cfg: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise AdapterError(f"config.json is missing {', '.join(missing)}")


def iter_expert_parts() -> Iterator[ExpertPart]:
    yield from ("gate", "up", "down")
