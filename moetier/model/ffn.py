"""Feed-forward blocks: the dense SwiGLU MLP and the MoE block around the expert provider.

Legend: T = rows, D = hidden, F = MLP width (dense F, shared-expert Fs), K = experts per token.

    MoE(x) = experts(x; router(x)) + [sigmoid(x @ shared_gate.T)] * SwiGLU_shared(x)

The routed part goes through an ExpertProvider (one call per layer per step with every row);
the shared expert is dense and resident, computed here -- while the routed part is under way
where the provider computes elsewhere (`start_moe`): the same sum, the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs
from moetier.model.ops import ExpertProvider, Ops, sigmoid, silu, start_moe
from moetier.model.router import Router
from moetier.model.weights import vector
from moetier.weights.quant import QTensor

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


class SwiGlu:
    """y = w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, dense: Mapping[str, QTensor], prefix: str) -> None:
        self.w_gate = dense[f"{prefix}.w_gate"]  # [F, D]
        self.w_up = dense[f"{prefix}.w_up"]  # [F, D]
        self.w_down = dense[f"{prefix}.w_down"]  # [D, F]

    def __call__(self, ops: Ops, x: F32) -> F32:
        hidden = silu(ops.linear(x, self.w_gate)) * ops.linear(x, self.w_up)  # [T, F]
        return ops.linear(hidden, self.w_down)  # [T, D]


class MoeBlock:
    def __init__(self, args: ModelArgs, layer: int, dense: Mapping[str, QTensor], prefix: str | None = None) -> None:
        """layer: the expert layer id its provider calls; prefix: its tensors (default "layers.{layer}")."""
        p = f"{prefix or f'layers.{layer}'}.moe"
        self.layer = layer
        bias = vector(dense[f"{p}.router_bias"]) if args.score_correction_bias else None
        logit_bias = vector(dense[f"{p}.router_logit_bias"]) if args.router_logit_bias else None
        self.router = Router(args, dense[f"{p}.router"], bias, logit_bias)
        self.shared = SwiGlu(dense, f"{p}.shared") if args.shared_intermediate_size else None
        self.shared_gate = dense[f"{p}.shared_gate"] if args.shared_expert_gate else None  # [1, D]

    def block(self, ops: Ops, experts: ExpertProvider, x: F32, norm: F32, eps: float) -> tuple[F32, I32] | None:
        """x + self(rmsnorm(x), route(rmsnorm(x))) in one kernel call (FastOps.moe_block, the same
        bits), where the provider holds every expert of the layer here (its `resident_table`), the
        router is a plain softmax and there is no shared expert: (x [T, D], ids [T, K]). None
        otherwise: the caller runs the steps."""
        fused = getattr(ops, "moe_block", None)
        resident, done = getattr(experts, "resident_table", None), getattr(experts, "resident_done", None)
        router = self.router
        if fused is None or resident is None or done is None or self.shared is not None or not router.plain_softmax:
            return None
        table = resident(self.layer, ops, router.weight.shape[0])
        if table is None:
            return None
        a = router.args
        t0 = time.perf_counter()
        y, ids, _ = fused(x, norm, eps, router.weight, router.logit_bias, a.num_experts_per_tok,
                          bool(a.norm_topk_prob), a.routed_scaling_factor, table)
        done(self.layer, ids, len(x), time.perf_counter() - t0)
        return y, ids

    def __call__(self, ops: Ops, experts: ExpertProvider, x: F32, ids: I32, weights: F32) -> F32:
        """x [T, D] (normed), routing ids/weights [T, K] -> [T, D]."""
        if self.shared is None:
            return np.ascontiguousarray(experts.moe(self.layer, x, ids, weights), dtype=np.float32)
        # the routed experts under way (a remote provider's round trip) while the shared one computes here
        call = start_moe(experts, self.layer, x, ids, weights)
        try:
            s = self.shared(ops, x)  # [T, D]
            if self.shared_gate is not None:
                g = ops.linear(x, self.shared_gate)  # [T, 1]
                s = s * sigmoid(g)
        except BaseException:
            call.abandon()
            raise
        y = call.result() + s  # [T, D]
        return np.ascontiguousarray(y, dtype=np.float32)
