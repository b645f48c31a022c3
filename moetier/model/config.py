"""Model shape: the one description of a model's architecture that the math reads.

Legend used throughout moetier/model:
    T = tokens in a step, S = cached positions, D = hidden size, V = vocab,
    H = query heads, Hkv = key/value heads, hd = head dim,
    E = routed experts, K = experts per token (top-k), I = expert intermediate size,
    F = dense MLP intermediate size, Hi = indexer heads, Di = indexer head dim,
    Hk/Hv = linear-attention key/value heads, dk/dv = their head dims, Kc = its conv kernel.

`ModelArgs` is architecture-neutral: each source architecture's quirks are
translated into these fields once, by its adapter in moetier/convert/adapters,
and stored in the container manifest. The math never looks at `arch`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

AttentionKind = Literal["gqa", "mla"]
QkNorm = Literal["none", "head", "full"]  # head: RMSNorm over hd per head; full: over H*hd (OLMoE)
ScoringFunc = Literal["softmax", "sigmoid", "topk_softmax"]  # topk_softmax: top-k of the logits, then softmax
ExpertActKind = Literal["silu", "clamped_swiglu"]
GroupScore = Literal["none", "max", "top2_sum"]  # DeepSeek-V2 group_limited_greedy / DeepSeek-V3


_DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim", "index_rope_interleave", "indexer_layers")
_LINEAR_FIELDS = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel", "attn_output_gate")
LayerType = Literal["full", "linear"]
# gpt-oss's fields, with the defaults every other model has (left out of the manifest at those defaults)
_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "attn_sinks": False, "o_bias": False, "sliding_window": 0, "sliding_layers": (), "router_logit_bias": False,
    "expert_bias": False, "expert_act": "silu", "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
}


@dataclass(frozen=True)
class ModelArgs:
    arch: str  # source model_type, informational only ("deepseek_v3", "mixtral", ...)
    vocab_size: int  # V (may exceed the tokenizer's size: padded rows are never sampled in practice)
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # Hkv; MLA: equal to H
    head_dim: int  # hd for GQA; MLA uses the fields below
    attention: AttentionKind = "gqa"

    # MLA (DeepSeek-V2/V3, GLM-5): K/V come from a compressed latent of kv_lora_rank floats
    # plus one shared rope key of qk_rope_head_dim floats per token -- that is what the KV cache holds.
    q_lora_rank: int | None = None  # None: one q projection (wq); else wq_a -> q_a_norm -> wq_b
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # RMSNorm epsilon of the MLA latents (q_a_norm, kv_a_norm): Hugging Face and DeepSeek's own
    # code build these norms with the RMSNorm default, not with rms_norm_eps.
    latent_norm_eps: float = 1e-6

    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every visible
    # position for each query and MLA attends to the best index_topk of them only. The indexer keeps
    # its own key cache (Di floats per position) in the layers that run it; indexer_layers[i] says
    # whether layer i runs its own indexer (GLM's "full") or reuses the previous one's choice ("shared").
    index_topk: int = 0  # 0: no indexer, dense attention
    index_n_heads: int = 0  # Hi
    index_head_dim: int = 0  # Di (its first qk_rope_head_dim dims are rotated)
    index_rope_interleave: bool = False  # GLM-5: interleaved pairs; DeepSeek-V3.2: halves
    indexer_layers: tuple[bool, ...] = ()

    # Hybrid linear attention (Qwen3-Next, Qwen3.5-MoE): layer_types[i] says whether layer i runs
    # full attention or a Gated DeltaNet, whose per-sequence state is fixed-size (a [Hv, dk, dv]
    # recurrent state and the last Kc - 1 inputs of its short convolution) instead of a growing KV.
    # Empty: every layer is full attention.
    layer_types: tuple[LayerType, ...] = ()
    linear_num_key_heads: int = 0  # Hk (queries and keys)
    linear_num_value_heads: int = 0  # Hv (a multiple of Hk: each key head serves Hv / Hk value heads)
    linear_key_head_dim: int = 0  # dk
    linear_value_head_dim: int = 0  # dv
    linear_conv_kernel: int = 0  # Kc
    # Gated full attention (Qwen3-Next): wq yields per head hd query rows then hd gate rows, and the
    # attention output is multiplied by sigmoid(gate) before wo
    attn_output_gate: bool = False

    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2-MoE, GLM-4.5 attention_bias)
    qk_norm: QkNorm = "none"
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c] after projection

    rope_theta: float = 10000.0
    rope_dim: int = 0  # rotary dims per head: hd * partial_rotary_factor (GQA), qk_rope_head_dim (MLA)
    rope_interleave: bool = False  # True: pairs (x0,x1),(x2,x3)...; False: halves (rotate_half)
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters when rope_type != "default" (yarn)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    # Feed-forward. moe_layers[i] says whether layer i is MoE (else a dense SwiGLU MLP of size F).
    intermediate_size: int = 0  # F
    moe_layers: tuple[bool, ...] = ()
    n_routed_experts: int = 0  # E
    num_experts_per_tok: int = 0  # K
    moe_intermediate_size: int = 0  # I
    shared_intermediate_size: int = 0  # shared-expert MLP size (0: none); n_shared * I for DeepSeek
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x @ shared_gate)

    # Router: scores = scoring_func(x @ router.T); choice = scores (+ router_bias);
    # optional group-limited choice; weights = scores at the chosen ids,
    # optionally renormalised, times routed_scaling_factor.
    scoring_func: ScoringFunc = "softmax"
    score_correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (choice only, not weights)
    group_score: GroupScore = "none"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    # gpt-oss: attention with a learned sink logit per head and an output-projection bias;
    # sliding_layers[i]: layer i attends to its last sliding_window positions only (and its KV
    # cache keeps only those); a router with a logit bias choosing top-k before its softmax;
    # experts with biases and the clamped SwiGLU (moetier.weights.quant.ExpertAct).
    attn_sinks: bool = False
    o_bias: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    router_logit_bias: bool = False
    expert_bias: bool = False
    expert_act: ExpertActKind = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # source fields kept for reference, never read by the math

    def __post_init__(self) -> None:
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"unknown attention kind {self.attention!r}")
        if self.num_heads % max(self.num_kv_heads, 1):
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.index_topk:
            if self.attention != "mla" or self.q_lora_rank is None:
                raise ValueError("the DSA indexer needs MLA attention with a q_lora_rank")
            if len(self.indexer_layers) != self.num_layers or not self.indexer_layers[0]:
                raise ValueError(f"indexer_layers needs {self.num_layers} entries and layer 0 must run its own "
                                 f"indexer, got {list(self.indexer_layers)}")
            if self.index_n_heads <= 0 or not 0 < self.qk_rope_head_dim <= self.index_head_dim:
                raise ValueError(f"indexer of {self.index_n_heads} heads x {self.index_head_dim} cannot rotate "
                                 f"{self.qk_rope_head_dim} dims")
        elif self.indexer_layers:
            raise ValueError("indexer_layers given without an index_topk")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or any(t not in ("full", "linear") for t in self.layer_types):
                raise ValueError(f"layer_types needs {self.num_layers} entries of 'full'/'linear', "
                                 f"got {list(self.layer_types)}")
            if "linear" in self.layer_types:
                dims = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                        self.linear_value_head_dim, self.linear_conv_kernel)
                if min(dims) <= 0 or self.linear_num_value_heads % self.linear_num_key_heads:
                    raise ValueError(f"linear attention needs positive sizes and value heads a multiple of key "
                                     f"heads, got (Hk, Hv, dk, dv, Kc) = {dims}")
                if self.attention != "gqa":
                    raise ValueError("linear attention layers are interleaved with GQA attention only")
        if self.sliding_layers and (len(self.sliding_layers) != self.num_layers or self.sliding_window <= 0):
            raise ValueError(f"sliding_layers needs {self.num_layers} entries and a sliding_window > 0, got "
                             f"{len(self.sliding_layers)} and {self.sliding_window}")
        if any(self.moe_layers):
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"top-k {self.num_experts_per_tok} invalid for {self.n_routed_experts} experts")
            if self.group_score != "none" and self.n_routed_experts % self.n_group:
                raise ValueError(f"{self.n_routed_experts} experts not divisible into {self.n_group} groups")

    # ---- derived shapes -------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope for MLA, hd for GQA."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def kv_cache_width(self) -> int:
        """Floats cached per token in every layer: MLA keeps the latent + rope key, GQA keeps K and V
        (indexer keys come on top, in the layers that run an indexer: `kv_floats_per_token`)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """linear_layers[i]: layer i is a Gated DeltaNet (all False without layer_types)."""
        return tuple(t == "linear" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the linear attention's convolution: q and k of every key head, v of every value head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def kv_floats_per_token(self) -> int:
        """Floats cached per token over all layers, indexer keys included (linear layers keep none)."""
        full = self.num_layers - sum(self.linear_layers)
        return full * self.kv_cache_width + self.index_head_dim * sum(self.indexer_layers)

    @property
    def state_floats(self) -> int:
        """Floats of one sequence's fixed-size state over all linear layers (recurrent + conv)."""
        per = (self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
               + max(self.linear_conv_kernel - 1, 0) * self.linear_conv_dim)
        return sum(self.linear_layers) * per

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (0: all of them)."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up: [I, D]; down: [D, I])."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    # ---- serialisation (container manifest) ----------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["indexer_layers"] = list(self.indexer_layers)
        d["layer_types"] = list(self.layer_types)
        if not self.index_topk:  # models without an indexer keep the manifest (and KV identity) they had
            for k in _DSA_FIELDS:
                del d[k]
        if not self.layer_types and not self.attn_output_gate:  # likewise models without linear attention
            for k in _LINEAR_FIELDS:
                del d[k]
        d["sliding_layers"] = list(self.sliding_layers)
        for k, v in _GPT_OSS_DEFAULTS.items():  # so do models without gpt-oss's mechanisms
            if getattr(self, k) == v:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelArgs fields: {sorted(unknown)}")
        d = dict(d)
        d["moe_layers"] = tuple(bool(x) for x in d.get("moe_layers", ()))
        d["eos_token_ids"] = tuple(int(x) for x in d.get("eos_token_ids", ()))
        d["indexer_layers"] = tuple(bool(x) for x in d.get("indexer_layers", ()))
        d["layer_types"] = tuple(str(x) for x in d.get("layer_types", ()))
        d["sliding_layers"] = tuple(bool(x) for x in d.get("sliding_layers", ()))
        return cls(**d)
