"""The in-process expert provider: the forward pass's routed experts through a RAM tier.

    experts = TieredExperts.open(container, ops, TierConfig(budget_bytes=8 << 30, policy="learned"))
    model = Model(container.args, dense, ops, experts)

Thin on purpose: each `moe` call acquires the layer's batch union from the tier
(misses read together, all pinned while the kernel runs) and hands it to
`Ops.moe`, the same kernel every provider ends in, so a tiered model computes
exactly what a model with every expert in memory computes.

Legend: T = rows, D = hidden, K = experts per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument
from moetier.model.ops import Ops
from moetier.store.index import ExpertIndex
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.container import Container

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


class TieredExperts:
    """ExpertProvider over an ExpertTier (moetier.model.ops.ExpertProvider)."""

    def __init__(self, container: Container | None, ops: Ops, tier: ExpertTier) -> None:
        if container is not None and tier.index.identity != container.index.identity:
            raise InvalidArgument(f"the expert tier serves index {tier.index.identity}, the container "
                                  f"{container.path} has {container.index.identity}")
        self.container = container
        self.ops = ops
        self.tier = tier
        self._last_layer = -1

    @classmethod
    def open(cls, container: Container, ops: Ops, config: TierConfig, **engine_options: Any) -> TieredExperts:
        """Tier over the container's expert files (engine options: mirrors, depth, direct, ...)."""
        return cls(container, ops, ExpertTier.open(ExpertIndex.from_container(container), config, **engine_options))

    def _note_layer(self, layer: int) -> None:
        # layers run in order within a step, so going back to an earlier layer starts a new step
        if layer < self._last_layer:
            self.tier.new_step()
        self._last_layer = layer

    def moe(self, layer: int, x: F32, ids: I32, weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D]."""
        self._note_layer(layer)
        with self.tier.acquire(layer, ids) as experts:
            return self.ops.moe(x, ids, weights, experts)

    def prefetch(self, layer: int, ids: I32) -> None:
        self._note_layer(layer)
        self.tier.prefetch(layer, ids)

    def close(self) -> None:
        self.tier.close()

    def __enter__(self) -> TieredExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
