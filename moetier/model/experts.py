"""In-memory expert provider: every routed expert held in a dict (tests, small models).

Legend: T = rows, D = hidden, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.model.ops import Ops
from moetier.weights.quant import ExpertWeights

F32 = npt.NDArray[np.float32]


class DictExperts:
    """ExpertProvider over {(layer, expert): ExpertWeights}; prefetch only counts its hints."""

    def __init__(self, experts: Mapping[tuple[int, int], ExpertWeights], ops: Ops) -> None:
        self.experts = experts
        self.ops = ops
        self.prefetch_calls = 0
        self._tables: dict[tuple[int, int], Any] = {}  # (layer, experts) -> FastOps.expert_table's table

    def moe(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D]."""
        try:
            needed = {int(e): self.experts[(layer, int(e))] for e in np.unique(ids)}
        except KeyError as err:
            raise KeyError(f"expert {err.args[0]} of layer {layer} is not loaded") from None
        return self.ops.moe(x, ids, weights, needed)

    def resident_table(self, layer: int, ops: Ops, n_experts: int) -> Any:
        """Every expert of `layer` as one kernel-side table (FastOps.expert_table, for
        MoeBlock.block) where all n_experts are in the mapping and `ops` are this provider's;
        None otherwise. A table is made once: the mapping's experts are not replaced meanwhile."""
        if ops is not self.ops:
            return None
        got = self._tables.get((layer, n_experts))
        if got is not None:
            return got
        make = getattr(ops, "expert_table", None)
        ws = [self.experts.get((layer, e)) for e in range(n_experts)]
        if make is None or not ws or any(w is None for w in ws):
            return None
        table = make(ws, ws[0].gate.shape[1])  # type: ignore[union-attr]
        if table is not None:
            self._tables[(layer, n_experts)] = table
        return table

    def resident_done(self, layer: int, ids: npt.NDArray[np.int32], rows: int, seconds: float) -> None:
        """A call computed from `resident_table`'s table: nothing to count here."""

    def prefetch(self, layer: int, ids: npt.NDArray[np.int32]) -> None:
        self.prefetch_calls += 1
