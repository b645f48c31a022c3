"""The in-process expert provider: the forward pass's routed experts through a RAM tier.

    experts = TieredExperts.open(container, ops, TierConfig(budget_bytes=8 << 30, policy="learned"))
    model = Model(container.args, dense, ops, experts)

Thin on purpose: each `moe` call acquires the layer's batch union from the tier
(misses read together, all pinned while the kernel runs) and computes it with the
two halves of `Ops.moe`, so a tiered model computes exactly what a model with every
expert in memory computes. A union larger than the budget is computed in waves
(`ExpertTier.waves`): pin a wave, compute the (row, slot) outputs of its experts into
one [T, K, D] buffer (`Ops.expert_outputs`), release, next wave; then the k-ordered
combine (`combine_slots`) that `Ops.moe` itself ends in. The expert store runs the same
`WaveSum` over the same waves. Waves change how often experts are read, never a bit.

Legend: T = rows, D = hidden, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument
from moetier.model.ops import Ops, combine_slots
from moetier.store.index import ExpertIndex
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.container import Container
from moetier.weights.quant import ExpertWeights

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


class WaveSum:
    """One MoE layer's output accumulated over waves of experts: `add` each wave's pinned
    experts (while they are pinned), then `result`. Bit for bit `ops.moe` over the union."""

    def __init__(self, ops: Ops, x: F32, ids: I32, weights: F32) -> None:
        self.ops, self.x, self.ids, self.weights = ops, x, ids, weights
        self.slots: F32 | None = None  # [T, K, D], made by the first wave (on the thread computing it)
        self.waves = 0

    def add(self, experts: Mapping[int, ExpertWeights]) -> None:
        if self.slots is None:
            self.slots = np.zeros((*self.ids.shape, self.x.shape[1]), dtype=np.float32)
        self.ops.expert_outputs(self.x, self.ids, experts, self.slots)
        self.waves += 1

    def result(self) -> F32:
        """[T, D], the slots summed in k order."""
        if self.slots is None:  # no wave: no rows, or no experts routed
            self.slots = np.zeros((*self.ids.shape, self.x.shape[1]), dtype=np.float32)
        return combine_slots(self.slots, self.weights)


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
        self.waves = 0  # waves computed (one per moe call whose union fits the budget)

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
        """x [T, D], ids/weights [T, K] -> [T, D]; in waves when the union exceeds the budget."""
        self._note_layer(layer)
        acc = WaveSum(self.ops, x, ids, weights)
        for wave in self.tier.waves(layer, ids):
            with self.tier.acquire(layer, wave) as experts:
                acc.add(experts)
        self.waves += acc.waves
        return acc.result()

    def prefetch(self, layer: int, ids: I32) -> None:
        self._note_layer(layer)
        self.tier.prefetch(layer, ids)

    def close(self) -> None:
        self.tier.close()

    def __enter__(self) -> TieredExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
