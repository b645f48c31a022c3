"""What a container of a given `ModelArgs` holds: every canonical dense tensor with its
shape, the routed-expert matrices, and the tensor class (and so the storage dtype) of each.

The canonical names are defined in moetier/convert/adapters/base.py. This module is the
one place that turns a `ModelArgs` into the full list of tensors, so the converter (shape
checks, completeness), synth (what to generate) and the reader (what must be present)
agree by construction.
"""

from __future__ import annotations

from typing import Literal

from moetier.model.config import ModelArgs
from moetier.weights.quant import QDType

TensorClass = Literal["experts", "dense", "exact"]
EXPERT_PARTS: tuple[str, ...] = ("gate", "up", "down")
EXPERTS_ALLOWED: tuple[QDType, ...] = ("int4", "int8", "bf16", "f32", "mxfp4")
DENSE_ALLOWED: tuple[QDType, ...] = ("int8", "int4", "bf16", "f32")
# The MTP head: int8 by default, never int4 (an int4 head drafts with 0-4% acceptance: the seed's
# measurement, docs/internals.md "The MTP head")
MTP_ALLOWED: tuple[QDType, ...] = ("int8", "bf16", "f32")

Shape = tuple[int, ...]


def dense_shapes(args: ModelArgs) -> dict[str, Shape]:
    """Canonical name -> shape of every dense tensor, in a fixed order (embed, layers, head)."""
    a = args
    d = a.hidden_size
    out: dict[str, Shape] = {"embed": (a.vocab_size, d)}
    for i in range(a.num_layers):
        out.update(layer_shapes(a, f"layers.{i}", moe=a.moe_layers[i],
                                indexer=bool(a.index_topk) and a.indexer_layers[i], linear=a.linear_layers[i]))
    out["final_norm"] = (d,)
    if not a.tie_word_embeddings:
        out["lm_head"] = (a.vocab_size, d)
    return out


def layer_shapes(a: ModelArgs, p: str, *, moe: bool, indexer: bool, linear: bool = False) -> dict[str, Shape]:
    """The dense tensors of one decoder layer named `p` ("layers.{i}", or "mtp.{k}" for the
    decoder block of a multi-token-prediction layer); `linear`: a Gated DeltaNet layer."""
    d = a.hidden_size
    out: dict[str, Shape] = {f"{p}.attn_norm": (d,)}
    if linear:
        hv, dv = a.linear_num_value_heads, a.linear_value_head_dim
        out[f"{p}.linear.wqkv"] = (a.linear_conv_dim, d)
        out[f"{p}.linear.wz"] = (hv * dv, d)
        out[f"{p}.linear.wb"] = (hv, d)
        out[f"{p}.linear.wa"] = (hv, d)
        out[f"{p}.linear.conv"] = (a.linear_conv_dim, a.linear_conv_kernel)
        out[f"{p}.linear.a_log"] = (hv,)
        out[f"{p}.linear.dt_bias"] = (hv,)
        out[f"{p}.linear.norm"] = (dv,)
        out[f"{p}.linear.wo"] = (d, hv * dv)
    elif a.attention == "mla":
        qk = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if a.q_lora_rank is None:
            out[f"{p}.attn.wq"] = (qk, d)
        else:
            out[f"{p}.attn.wq_a"] = (a.q_lora_rank, d)
            out[f"{p}.attn.q_a_norm"] = (a.q_lora_rank,)
            out[f"{p}.attn.wq_b"] = (qk, a.q_lora_rank)
        out[f"{p}.attn.wkv_a"] = (a.kv_lora_rank + a.qk_rope_head_dim, d)
        out[f"{p}.attn.kv_a_norm"] = (a.kv_lora_rank,)
        out[f"{p}.attn.wkv_b"] = (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
        out[f"{p}.attn.wo"] = (d, a.num_heads * a.v_head_dim)
        if indexer:
            assert a.q_lora_rank is not None
            out[f"{p}.attn.index_wq_b"] = (a.index_n_heads * a.index_head_dim, a.q_lora_rank)
            out[f"{p}.attn.index_wk"] = (a.index_head_dim, d)
            out[f"{p}.attn.index_k_norm"] = (a.index_head_dim,)
            out[f"{p}.attn.index_k_bias"] = (a.index_head_dim,)
            out[f"{p}.attn.index_weights"] = (a.index_n_heads, d)
    else:
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        out[f"{p}.attn.wq"] = (2 * q if a.attn_output_gate else q, d)  # gated: [q | gate] rows per head
        out[f"{p}.attn.wk"] = (kv, d)
        out[f"{p}.attn.wv"] = (kv, d)
        out[f"{p}.attn.wo"] = (d, q)
        if a.qkv_bias:
            out[f"{p}.attn.bq"] = (q,)
            out[f"{p}.attn.bk"] = (kv,)
            out[f"{p}.attn.bv"] = (kv,)
        if a.o_bias:
            out[f"{p}.attn.bo"] = (d,)
        if a.attn_sinks:
            out[f"{p}.attn.sinks"] = (a.num_heads,)
        if a.qk_norm == "head":
            out[f"{p}.attn.q_norm"] = (a.head_dim,)
            out[f"{p}.attn.k_norm"] = (a.head_dim,)
        elif a.qk_norm == "full":
            out[f"{p}.attn.q_norm"] = (q,)
            out[f"{p}.attn.k_norm"] = (kv,)
    out[f"{p}.ffn_norm"] = (d,)
    if moe:
        out[f"{p}.moe.router"] = (a.n_routed_experts, d)
        if a.score_correction_bias:
            out[f"{p}.moe.router_bias"] = (a.n_routed_experts,)
        if a.router_logit_bias:
            out[f"{p}.moe.router_logit_bias"] = (a.n_routed_experts,)
        fs = a.shared_intermediate_size
        if fs:
            out[f"{p}.moe.shared.w_gate"] = (fs, d)
            out[f"{p}.moe.shared.w_up"] = (fs, d)
            out[f"{p}.moe.shared.w_down"] = (d, fs)
            if a.shared_expert_gate:
                out[f"{p}.moe.shared_gate"] = (1, d)
    else:
        f = a.intermediate_size
        out[f"{p}.mlp.w_gate"] = (f, d)
        out[f"{p}.mlp.w_up"] = (f, d)
        out[f"{p}.mlp.w_down"] = (d, f)
    return out


def mtp_shapes(args: ModelArgs, layers: int) -> dict[str, Shape]:
    """The dense tensors of `layers` multi-token-prediction layers (DeepSeek-V3's MTP modules,
    transformers' MtpLayer): per depth k, `mtp.{k}.enorm`/`.hnorm` [D] (norms of the token
    embedding and of the incoming hidden state), `mtp.{k}.eh_proj` [D, 2D] (their concatenation
    projected), a MoE decoder block under `mtp.{k}.` (with its own indexer in DSA models), and
    `mtp.{k}.head_norm` [D] before the shared lm_head. Embedding and lm_head are the main model's."""
    d = args.hidden_size
    out: dict[str, Shape] = {}
    for k in range(layers):
        p = f"mtp.{k}"
        out[f"{p}.enorm"] = (d,)
        out[f"{p}.hnorm"] = (d,)
        out[f"{p}.eh_proj"] = (d, 2 * d)
        out.update(layer_shapes(args, p, moe=True, indexer=bool(args.index_topk)))
        out[f"{p}.head_norm"] = (d,)
    return out


def expert_shapes(args: ModelArgs) -> dict[str, Shape]:
    """Shapes of one routed expert's matrices: gate/up [I, D], down [D, I]."""
    i, d = args.moe_intermediate_size, args.hidden_size
    return {"gate": (i, d), "up": (i, d), "down": (d, i)}


def tensor_class(name: str, shape: Shape) -> TensorClass:
    """Class of a canonical dense tensor (internals.md, 'Quantized tensors')."""
    leaf = name.rsplit(".", 1)[-1]
    # index_weights: the DSA indexer's per-head weights, kept float32 as transformers keeps it;
    # conv, wa, wb: the linear attention's convolution taps and its decay / write-strength gates
    # (small, and every later token's state depends on them)
    if len(shape) < 2 or "norm" in leaf or leaf in ("router", "router_bias", "shared_gate", "bq", "bk", "bv",
                                                      "index_weights", "conv", "wa", "wb"):
        return "exact"
    return "dense"


def storage_dtype(name: str, shape: Shape, dense: QDType) -> QDType:
    """The dtype a dense tensor is stored in, given the container's dense dtype."""
    return "f32" if tensor_class(name, shape) == "exact" else dense
