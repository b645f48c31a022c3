"""The tier-compute loop: one MoE layer's routed experts over the RAM tier. The in-process
engine (`TieredExperts`) and the expert store both compute through it, so they give the same
bits and the same accounting.

    compute = TierCompute(tier, ops)
    result = compute.run(layer, x, ids, weights)     # ComputeResult: output [T, D], hits, misses, ...

    job = compute.start(layer, x, ids, weights, block=False)   # the first wave pinned, or None
    result = compute.finish(job)                                  # on whichever thread computes

Per wave of the batch union (`ExpertTier.waves`: one wave when the union fits the budget):
pin the wave (`ExpertTier.begin`: the resident experts pinned, the missing ones queued for
reading together), compute the (row, slot) outputs of its experts as they become usable
(`Lease.arrivals`: the resident ones at once, while the missing ones are read, then each read
as it completes) into one [T, K, D] buffer (`Ops.expert_outputs`), release the wave; after
the last wave the k-ordered combine (`combine_slots`) that `Ops.moe` itself ends in. Which
wave an expert is in and when its read completes change how often experts are read and when
they are computed, never a bit: each slot is computed from its own row and expert alone.

Legend: T = rows, D = hidden, K = experts per row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from moetier.model.ops import Ops, combine_slots
from moetier.store.tier import ExpertTier, Lease

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


@dataclass
class ComputeResult:
    output: F32  # [T, D]
    hits: int  # experts of the batch union found in RAM
    misses: int  # experts of the batch union read (or joined to a read in flight)
    load_ns: int  # pinning the union and waiting for reads beyond the compute that overlapped them
    compute_ns: int  # the kernels (every wave and the combine)
    waves: int = 1  # pin-compute-release rounds: more than one when the union exceeds the budget
    settled: bool = False  # the tier was settled when the call ended (ExpertTier.settled)


@dataclass
class ComputeStats:
    """Totals since start (monotonic)."""

    calls: int = 0
    rows: int = 0
    waves: int = 0
    hits: int = 0
    misses: int = 0
    load_s: float = 0.0
    compute_s: float = 0.0


class ComputeJob:
    """One call under way: its inputs, its waves, the first wave's lease once pinned."""

    def __init__(self, layer: int, x: F32, ids: I32, weights: F32, waves: list[list[int]],
                 lease: Lease, pin_ns: int, slot_outputs: bool = False) -> None:
        self.layer, self.x, self.ids, self.weights, self.waves = layer, x, ids, weights, waves
        self.slot_outputs = slot_outputs
        self.lease: Lease | None = lease  # the first wave's, until `finish` takes it
        self.pin_ns = pin_ns

    @property
    def resident(self) -> bool:
        """The first wave needs no read: computing it never waits for the disk."""
        return self.lease is not None and self.lease.misses == 0 and len(self.waves) == 1

    def abandon(self) -> None:
        """Nobody will `finish` this job: release what it holds."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class TierCompute:
    def __init__(self, tier: ExpertTier, ops: Ops) -> None:
        self.tier, self.ops = tier, ops
        self.stats = ComputeStats()
        self._lock = threading.Lock()

    def run(self, layer: int, x: F32, ids: I32, weights: F32, *, slot_outputs: bool = False) -> ComputeResult:
        """x [T, D], ids/weights [T, K] -> the layer's routed experts [T, D], here and now.
        slot_outputs: ids may hold -1 (a slot computed elsewhere: a sharded placement); the
        output is then [N, D], the unweighted output of every slot with an id >= 0 in row-major
        (t, k) order, for the caller to place in its [T, K, D] buffer and combine itself."""
        job = self.start(layer, x, ids, weights, block=True, slot_outputs=slot_outputs)
        assert job is not None
        return self.finish(job)

    def start(self, layer: int, x: F32, ids: I32, weights: F32, *, block: bool,
              slot_outputs: bool = False) -> ComputeJob | None:
        """Cut the union into waves and pin the first (its reads queued). With block=False, None
        when the budget has no room now (other computes hold it): `run` or `start(block=True)` on
        a thread that may wait then."""
        t0 = time.perf_counter_ns()
        waves = self.tier.waves(layer, ids[ids >= 0] if slot_outputs else ids)
        lease = self.tier.begin(layer, waves[0], block=block)
        if lease is None:
            return None
        return ComputeJob(layer, x, ids, weights, waves, lease, time.perf_counter_ns() - t0, slot_outputs)

    def finish(self, job: ComputeJob) -> ComputeResult:
        """Compute every wave of `job` (each expert as soon as it is usable), then combine.
        Releases every lease it pins, also when it fails."""
        x, ids = job.x, job.ids
        slots: F32 | None = None  # [T, K, D], made when a wave computes slot by slot
        y: F32 | None = None  # [T, D]: one wave, every expert resident, experts and combine in one call
        # (Ops.moe_plain, where the ops have it: the same bits as the slots and combine_slots)
        one_call = None if job.slot_outputs or len(job.waves) != 1 or job.weights.dtype != np.float32 \
            else getattr(self.ops, "moe_plain", None)
        load_ns, compute_ns, hits, misses = job.pin_ns, 0, 0, 0
        try:
            for n, wave in enumerate(job.waves):
                if n == 0:
                    lease, job.lease = job.lease, None
                    assert lease is not None, "a job is finished once"
                else:
                    t0 = time.perf_counter_ns()
                    lease = self.tier.begin(job.layer, wave)
                    assert lease is not None
                    load_ns += time.perf_counter_ns() - t0
                try:
                    hits += len(lease.entries) - lease.misses
                    misses += lease.misses
                    for experts in lease.arrivals():
                        t0 = time.perf_counter_ns()
                        if one_call is not None and lease.misses == 0:  # the only arrival holds every expert
                            y = one_call(x, ids, job.weights, experts)
                        if y is None:
                            if slots is None:
                                slots = np.zeros((*ids.shape, x.shape[1]), dtype=np.float32)
                            self.ops.expert_outputs(x, ids, experts, slots)
                        compute_ns += time.perf_counter_ns() - t0
                    load_ns += int(lease.wait_s * 1e9)
                finally:
                    lease.release()
        finally:
            job.abandon()  # a job that failed before its first wave still holds that lease
        t0 = time.perf_counter_ns()
        if y is None:
            if slots is None:  # no expert arrived (no rows)
                slots = np.zeros((*ids.shape, x.shape[1]), dtype=np.float32)
            # [N, D] the computed slots, uncombined (the caller sums every store's in k order), or [T, D]
            y = slots[ids >= 0] if job.slot_outputs else combine_slots(slots, job.weights)
        compute_ns += time.perf_counter_ns() - t0
        with self._lock:
            s = self.stats
            s.calls += 1
            s.rows += x.shape[0]
            s.waves += len(job.waves)
            s.hits += hits
            s.misses += misses
            s.load_s += load_ns / 1e9
            s.compute_s += compute_ns / 1e9
        return ComputeResult(y, hits, misses, load_ns, compute_ns, len(job.waves), self.tier.settled())

    def note(self, rows: int, hits: int, seconds: float) -> None:
        """A one-wave call with every expert resident, computed elsewhere from the tier's
        records (TieredExperts.resident_done): counted in the totals as `finish` counts one."""
        with self._lock:
            s = self.stats
            s.calls += 1
            s.rows += rows
            s.waves += 1
            s.hits += hits
            s.compute_s += seconds

    def totals(self) -> ComputeStats:
        with self._lock:
            return ComputeStats(**vars(self.stats))
