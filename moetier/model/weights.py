"""The dense tensors a model needs, checked once at load, and row-wise embedding lookup.

Legend: V = vocab, D = hidden, H/Hkv = heads, hd = head dim, F = dense MLP size,
Fs = shared-expert size, E = routed experts, n = looked-up rows.
Canonical names are documented in moetier/convert/adapters/base.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError
from moetier.model.config import ModelArgs
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]


def _attention_shapes(args: ModelArgs, p: str) -> dict[str, tuple[int, ...]]:
    d, h = args.hidden_size, args.num_heads
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        out: dict[str, tuple[int, ...]] = {}
        if args.q_lora_rank is None:
            out[f"{p}.wq"] = (h * qk, d)
        else:
            out[f"{p}.wq_a"] = (args.q_lora_rank, d)
            out[f"{p}.q_a_norm"] = (args.q_lora_rank,)
            out[f"{p}.wq_b"] = (h * qk, args.q_lora_rank)
        out[f"{p}.wkv_a"] = (args.kv_lora_rank + args.qk_rope_head_dim, d)
        out[f"{p}.kv_a_norm"] = (args.kv_lora_rank,)
        out[f"{p}.wkv_b"] = (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
        out[f"{p}.wo"] = (d, h * args.v_head_dim)
        return out
    hd, hkv = args.head_dim, args.num_kv_heads
    out = {f"{p}.wq": (h * hd, d), f"{p}.wk": (hkv * hd, d), f"{p}.wv": (hkv * hd, d), f"{p}.wo": (d, h * hd)}
    if args.qkv_bias:
        out.update({f"{p}.bq": (h * hd,), f"{p}.bk": (hkv * hd,), f"{p}.bv": (hkv * hd,)})
    if args.qk_norm == "head":
        out.update({f"{p}.q_norm": (hd,), f"{p}.k_norm": (hd,)})
    elif args.qk_norm == "full":
        out.update({f"{p}.q_norm": (h * hd,), f"{p}.k_norm": (hkv * hd,)})
    return out


def dense_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every dense tensor the forward pass reads, by canonical name, with its logical shape."""
    d = args.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed": (args.vocab_size, d), "final_norm": (d,)}
    if not args.tie_word_embeddings:
        out["lm_head"] = (args.vocab_size, d)
    for i in range(args.num_layers):
        p = f"layers.{i}"
        out[f"{p}.attn_norm"] = (d,)
        out[f"{p}.ffn_norm"] = (d,)
        out.update(_attention_shapes(args, f"{p}.attn"))
        if not args.moe_layers[i]:
            f = args.intermediate_size
            out.update({f"{p}.mlp.w_gate": (f, d), f"{p}.mlp.w_up": (f, d), f"{p}.mlp.w_down": (d, f)})
            continue
        out[f"{p}.moe.router"] = (args.n_routed_experts, d)
        if args.score_correction_bias:
            out[f"{p}.moe.router_bias"] = (args.n_routed_experts,)
        fs = args.shared_intermediate_size
        if fs:
            out.update({f"{p}.moe.shared.w_gate": (fs, d), f"{p}.moe.shared.w_up": (fs, d),
                        f"{p}.moe.shared.w_down": (d, fs)})
            if args.shared_expert_gate:
                out[f"{p}.moe.shared_gate"] = (1, d)
    return out


def check_dense(args: ModelArgs, dense: Mapping[str, QTensor]) -> None:
    """Raise FormatError naming the first missing or misshapen tensor."""
    for name, shape in dense_shapes(args).items():
        t = dense.get(name)
        if t is None:
            raise FormatError(f"dense tensor {name!r} is missing (expected shape {list(shape)})")
        if tuple(t.shape) != shape:
            raise FormatError(f"dense tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")


def vector(t: QTensor) -> F32:
    """A 1-D tensor (norm weight, bias) as float32."""
    return np.ascontiguousarray(t.dequantize(), dtype=np.float32).reshape(-1)


def embed_rows(embed: QTensor, ids: npt.NDArray[np.integer]) -> F32:
    """Rows `ids` of the embedding [V, D] -> [n, D], dequantizing only those rows."""
    rows = QTensor(
        embed.dtype,
        (len(ids), embed.shape[1]),
        embed.data[ids],
        None if embed.scales is None else embed.scales[ids],
        embed.group_size,
    )
    return np.ascontiguousarray(rows.dequantize(), dtype=np.float32)
