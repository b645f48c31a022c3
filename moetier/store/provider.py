"""The in-process expert provider: the forward pass's routed experts through a RAM tier.

    experts = TieredExperts.open(container, ops, TierConfig(budget_bytes=8 << 30, policy="learned"))
    model = Model(container.args, dense, ops, experts)

Thin on purpose: each `moe` call is one run of the tier-compute loop (`TierCompute`,
moetier/store/compute.py), the loop the expert store runs for each ComputeExperts: the
layer's batch union pinned wave by wave, each expert computed as soon as it is resident
(resident ones while the missing ones are read), then the k-ordered combine that
`Ops.moe` itself ends in. So a tiered model computes exactly what a model with every
expert in memory computes, and exactly what the expert store computes.

A layer with a shared expert starts its routed experts with `moe_start`: when some of them
must be read, the loop runs on one helper thread while the step thread computes the shared
expert, so the reads overlap that too (as in the cluster, where the store computes while
the worker does); when all are resident it runs here, with no hand-off.

Legend: T = rows, D = hidden, K = experts per token.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument
from moetier.model.ops import DoneCall, Ops
from moetier.store.compute import ComputeResult, ComputeStats, TierCompute
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
        self.compute = TierCompute(tier, ops)
        self._last_layer = -1
        self._helper: ThreadPoolExecutor | None = None  # runs `moe_start` calls that wait for reads
        self._tables: dict[tuple[int, int], Any] = {}  # (layer, experts) -> resident_table's table

    @classmethod
    def open(cls, container: Container, ops: Ops, config: TierConfig, **engine_options: Any) -> TieredExperts:
        """Tier over the container's expert files (engine options: mirrors, depth, direct, ...)."""
        return cls(container, ops, ExpertTier.open(container.index, config, **engine_options))

    def _note_layer(self, layer: int) -> None:
        # layers run in order within a step, so going back to an earlier layer starts a new step
        if layer < self._last_layer:
            self.tier.new_step()
        self._last_layer = layer

    def wants_hints(self) -> bool:
        """False while the tier is settled (ExpertTier.settled; moetier.model.ops.wants_hints)."""
        return not self.tier.settled()

    def moe(self, layer: int, x: F32, ids: I32, weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D]; in waves when the union exceeds the budget."""
        self._note_layer(layer)
        return self.compute.run(layer, x, ids, weights).output

    def resident_table(self, layer: int, ops: Ops, n_experts: int) -> Any:
        """Every expert of `layer` as one kernel-side table (FastOps.expert_table, for
        MoeBlock.block) where the tier never evicts and holds all n_experts of it, and `ops` are
        this provider's; None otherwise (the call goes through `moe`)."""
        if ops is not self.ops:
            return None
        key = (layer, n_experts)
        table = self._tables.get(key)
        if table is not None:
            return table
        make = getattr(ops, "expert_table", None)
        if make is None:
            return None
        values = self.tier.resident_values(layer, n_experts)
        if not values:
            return None
        table = make(values, values[0].gate.shape[1])
        if table is not None:
            self._tables[key] = table  # a roomy tier never evicts: the table stays right
        return table

    def resident_done(self, layer: int, ids: I32, rows: int, seconds: float) -> None:
        """A call computed from `resident_table`'s table, counted as the tier counts its calls
        (hits, usage, the policy's record; the compute totals)."""
        self._note_layer(layer)
        union = np.unique(ids)
        self.tier.note_shared(layer, union.astype(np.int64), np.ones(len(union), dtype=np.int64))
        self.compute.note(rows, len(union), seconds)

    def moe_start(self, layer: int, x: F32, ids: I32, weights: F32) -> _Pending | DoneCall:
        """`moe` under way (see the module docstring); `result()` gives its output."""
        self._note_layer(layer)
        job = self.compute.start(layer, x, ids, weights, block=True)
        assert job is not None
        if job.resident:
            return DoneCall(self.compute.finish(job).output)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetier-experts")
        return _Pending(self._helper.submit(self.compute.finish, job))

    @property
    def waves(self) -> int:
        """Waves computed (one per moe call whose union fits the budget)."""
        return self.compute.stats.waves

    def stats(self) -> ComputeStats:
        """The calls' totals: rows, waves, hits, misses, time pinning + waiting for reads, kernels."""
        return self.compute.totals()

    def prefetch(self, layer: int, ids: I32) -> None:
        self._note_layer(layer)
        self.tier.prefetch(layer, ids)

    def close(self) -> None:
        self._tables = {}
        if self._helper is not None:
            self._helper.shutdown(wait=True)
        self.tier.close()

    def __enter__(self) -> TieredExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pending:
    def __init__(self, fut: Future[ComputeResult]) -> None:
        self._fut = fut

    def result(self) -> F32:
        return self._fut.result().output

    def abandon(self) -> None:
        """The loop releases its pins when it ends; nobody reads its output."""
