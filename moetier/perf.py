"""The performance model (DESIGN.md, docs/internals.md "Benchmarks"), in one place: the bounds
`moetier bench e2e` prints beside its measurement, and what `moetier plan` and the simulator
predict with.

For one decode step at batch B:
  * missed bytes  = Σ over MoE layers of the union's experts that must come from disk x record
    bytes; disk bound = missed bytes / the disks' read GB/s (fio, O_DIRECT, block = record);
  * touched bytes = Σ over MoE layers of the union's experts x record bytes + the dense bytes a
    step reads (every dense tensor, the embedding table as one row per token); memory bound =
    touched bytes / memory GB/s (a large copy, as `bench compute`);
  * compute bound = touched bytes / the kernels' GB/s of weights at that batch (`bench compute`'s
    figure; it is below the memory bandwidth on a CPU whose kernels do not keep up);
  * the target: max(disk, memory, compute), since reads overlap compute (prefetch of the next
    layer's predicted experts); `serial_s` is the same step with no overlap at all (the reads,
    then the compute), the upper estimate of a step.

Copies of the experts (a mirror) split reads by bandwidth: records held by several disks go to
each in proportion to its GB/s, the rest to the disk holding them; the slowest disk's share
bounds the time (`disk_seconds`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from moetier.model.config import ModelArgs
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import QDType
from moetier.weights.writer import planned_dense


@dataclass(frozen=True)
class ModelCosts:
    """The byte counts of a model shape at a quantization (what a step moves)."""

    name: str
    moe_layers: int
    n_experts: int
    top_k: int
    record_bytes: int  # one routed expert's record (gate + up + down + scales, 4 KiB padded)
    expert_bytes: int  # every routed expert
    dense_bytes: int  # every dense tensor, resident
    dense_step_bytes: int  # dense bytes a decode token reads (the embedding as one row)
    kv_bytes_per_token: int  # float32 KV of one position, all layers

    @classmethod
    def of(cls, args: ModelArgs, name: str = "", experts: QDType = "int4", dense: QDType = "int8",
           group_size: int = 64) -> ModelCosts:
        record = RecordLayout.build(args.moe_intermediate_size, args.hidden_size, experts, group_size).record_bytes
        dense_bytes = step = 0
        for tname, spec in planned_dense(args, dense, group_size).items():
            n = _dense_nbytes(spec.dtype, spec.shape, spec.group_size)
            dense_bytes += n
            step += n // spec.shape[0] if tname == "embed" else n
        moe = len(args.moe_layer_ids)
        return cls(name or args.arch, moe, args.n_routed_experts, args.num_experts_per_tok, record,
                   moe * args.n_routed_experts * record, dense_bytes, step, 4 * args.num_layers * args.kv_cache_width)

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one token routes to (top-k of every MoE layer)."""
        return self.moe_layers * self.top_k * self.record_bytes


def _dense_nbytes(dtype: str, shape: tuple[int, ...], group: int) -> int:
    n = 1
    for s in shape:
        n *= s
    if dtype == "f32":
        return 4 * n
    if dtype == "bf16":
        return 2 * n
    rows, cols = (shape[0], shape[-1]) if len(shape) == 2 else (1, shape[0])
    cp = -(-cols // group) * group
    data = rows * cp if dtype == "int8" else rows * cp // 2
    return data + 2 * rows * (cp // group)


@dataclass(frozen=True)
class Disk:
    """One copy of the experts: its read GB/s and the share of the records it holds."""

    gbps: float
    holds: float = 1.0  # 1.0: every record (the primary); a partial mirror less


@dataclass(frozen=True)
class Rates:
    """A machine's measured (or given) rates."""

    disks: tuple[Disk, ...]
    memory_gbps: float
    compute_gbps: float | None = None  # kernels' GB/s of weights at batch 1; None: not a bound

    @property
    def disk_gbps(self) -> float:
        """The effective GB/s of all copies together (`disk_seconds` of 1 GB)."""
        return 1.0 / disk_seconds(1e9, self.disks)


def disk_seconds(nbytes: float, disks: Sequence[Disk]) -> float:
    """Time to read `nbytes` of uniformly placed records from the copies: records that several
    disks hold are split by GB/s, the rest read where they are; the busiest disk bounds it."""
    if nbytes <= 0:
        return 0.0
    if not disks or any(d.gbps <= 0 for d in disks):
        raise ValueError("every disk needs a positive GB/s")
    mirrors = disks[1:]
    share = [0.0] * len(disks)
    # each mirror holds a share of the records; a record on the primary and some mirrors is
    # read from them in proportion to GB/s. Mirrors are taken as nested (a smaller one's records
    # are on every larger one), the simplest placement that gives each its share.
    cuts = sorted({0.0, 1.0, *(min(1.0, max(0.0, m.holds)) for m in mirrors)})
    for lo, hi in itertools.pairwise(cuts):
        holders = [0] + [i + 1 for i, m in enumerate(mirrors) if m.holds >= hi]
        total = sum(disks[i].gbps for i in holders)
        for i in holders:
            share[i] += (hi - lo) * disks[i].gbps / total
    return max(nbytes * s / (d.gbps * 1e9) for s, d in zip(share, disks, strict=True))


@dataclass(frozen=True)
class StepBounds:
    missed_bytes: float
    touched_bytes: float
    disk_s: float
    memory_s: float
    compute_s: float  # 0 when the compute rate is not known

    @property
    def bound_s(self) -> float:
        """max(disk, memory, compute): reads overlapping compute, the target."""
        return max(self.disk_s, self.memory_s, self.compute_s)

    @property
    def serial_s(self) -> float:
        """The step with no overlap: its reads, then its compute."""
        return self.disk_s + max(self.memory_s, self.compute_s)

    @property
    def binding(self) -> str:
        """Which bound the step is at: disk, memory or compute."""
        return max((self.disk_s, "disk"), (self.memory_s, "memory"), (self.compute_s, "compute"))[1]


def step_bounds(missed_bytes: float, touched_bytes: float, rates: Rates) -> StepBounds:
    """The bounds of one step that reads `missed_bytes` from disk and touches `touched_bytes`."""
    compute = touched_bytes / (rates.compute_gbps * 1e9) if rates.compute_gbps else 0.0
    return StepBounds(missed_bytes, touched_bytes, disk_seconds(missed_bytes, rates.disks),
                      touched_bytes / (rates.memory_gbps * 1e9), compute)


def decode_bytes(costs: ModelCosts, union_experts: float, missed_experts: float) -> tuple[float, float]:
    """(missed, touched) bytes of a step whose MoE layers' unions hold `union_experts` experts in
    all, `missed_experts` of them read from disk (bench e2e counts them the same way)."""
    return missed_experts * costs.record_bytes, union_experts * costs.record_bytes + costs.dense_step_bytes
