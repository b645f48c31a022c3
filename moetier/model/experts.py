"""In-memory expert provider: every routed expert held in a dict (tests, small models).

Legend: T = rows, D = hidden, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping

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

    def moe(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D]."""
        try:
            needed = {int(e): self.experts[(layer, int(e))] for e in np.unique(ids)}
        except KeyError as err:
            raise KeyError(f"expert {err.args[0]} of layer {layer} is not loaded") from None
        return self.ops.moe(x, ids, weights, needed)

    def prefetch(self, layer: int, ids: npt.NDArray[np.int32]) -> None:
        self.prefetch_calls += 1
