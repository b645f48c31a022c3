"""`moetier plan`'s domain: placement of a model on a machine, and its predicted speed.

    p = plan(costs, machine, context=4096, tokens=64, prompt_tokens=1000)
    p.placement        # dense resident, KV at the context, expert cache bytes and share, disks
    p.simulation       # cold and warm decode (moetier.simulate), p.ttft_s, p.ttft_binding

Placement: the expert cache is what RAM leaves after the fixed overhead (the OS and the
services' runtimes), the resident dense part and the KV of `context` tokens of `batch`
sequences, in whole records: (memory - fixed overhead) / record size, as the seed sizes it.
Prediction: the simulator over a routing trace at the model's shape, each step timed by the
performance model (moetier/perf.py). TTFT: the prompt as one step of `prompt_tokens` rows: the
union of its routing read from an empty cache, every weight byte touched once, and the kernels
at their batch-16 rate per 16 rows (prefill is FMA-bound, not bandwidth-bound); the largest of
disk, memory and compute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moetier.perf import Disk, ModelCosts, Rates, step_bounds
from moetier.simulate import Simulation, simulate, synthetic_trace
from moetier.store.trace import SynthSpec, Trace, temporal_trace

PREFILL_ROWS = 16  # rows per weight pass at the kernels' batched rate (bench compute's batch 16)


@dataclass(frozen=True)
class Machine:
    ram_bytes: int
    overhead_bytes: int  # the OS and the services' runtimes, never for the caches
    disks: tuple[Disk, ...]  # the primary, then mirrors
    memory_gbps: float
    compute_gbps: float | None  # kernels at batch 1 (None: unknown, not a bound)
    compute_gbps_batched: float | None  # kernels at batch PREFILL_ROWS
    sources: dict[str, str]  # where each figure came from: given, profile, measured now

    def rates(self, batched: bool = False) -> Rates:
        return Rates(self.disks, self.memory_gbps, self.compute_gbps_batched if batched else self.compute_gbps)


@dataclass(frozen=True)
class Placement:
    dense_bytes: int
    kv_bytes: int
    context: int
    batch: int
    expert_cache_bytes: int
    experts_cached: int
    expert_bytes: int
    disk_bytes: tuple[int, ...]  # expert bytes each disk holds (primary first)

    @property
    def cache_fraction(self) -> float:
        return self.expert_cache_bytes / self.expert_bytes if self.expert_bytes else 0.0

    @property
    def fits(self) -> bool:
        return self.experts_cached > 0


@dataclass(frozen=True)
class Plan:
    costs: ModelCosts
    machine: Machine
    placement: Placement
    simulation: Simulation | None  # None when no expert fits in RAM
    ttft_s: float
    ttft_binding: str
    prompt_tokens: int
    trace: str  # what the routing came from

    def to_dict(self) -> dict[str, Any]:
        sim = self.simulation
        out: dict[str, Any] = {"model": asdict(self.costs), "machine": asdict(self.machine),
                               "placement": {**asdict(self.placement), "cache_fraction": self.placement.cache_fraction,
                                             "fits": self.placement.fits},
                               "trace": self.trace, "prompt_tokens": self.prompt_tokens, "ttft_s": self.ttft_s,
                               "ttft_binding": self.ttft_binding}
        if sim is not None:
            out["policy"], out["prefetch_recall"] = sim.policy, sim.recall
            for name, ph in (("cold", sim.cold), ("warm", sim.warm)):
                out[name] = {**asdict(ph), "binding": ph.binding, "tok_s": ph.tok_s, "tok_s_serial": ph.tok_s_serial,
                             "tok_s_expected": ph.tok_s_expected}
        return out


def place(costs: ModelCosts, machine: Machine, context: int, batch: int = 1) -> Placement:
    kv = costs.kv_bytes_per_token * context * batch
    cache = machine.ram_bytes - machine.overhead_bytes - costs.dense_bytes - kv
    n = max(0, min(cache // costs.record_bytes, costs.moe_layers * costs.n_experts))
    held = tuple(int(costs.expert_bytes * min(1.0, d.holds)) for d in machine.disks)
    return Placement(costs.dense_bytes, kv, context, batch, max(0, n * costs.record_bytes), n, costs.expert_bytes,
                     held)


def prefill(costs: ModelCosts, machine: Machine, prompt_tokens: int, seed: int = 0) -> tuple[float, str]:
    """(TTFT seconds, binding bound) of a prompt from an empty cache (see the module docstring)."""
    spec = SynthSpec(layers=costs.moe_layers, n_experts=costs.n_experts, top_k=costs.top_k, batch=prompt_tokens,
                     steps=1)
    step = temporal_trace(spec, seed=seed)[0]
    union = sum(int(np.unique(ids).size) for _, ids in step)
    touched = union * costs.record_bytes + costs.dense_bytes
    b = step_bounds(union * costs.record_bytes, touched, Rates(machine.disks, machine.memory_gbps))
    compute = 0.0
    if machine.compute_gbps_batched:
        per_token = costs.active_expert_bytes + costs.dense_step_bytes
        compute = prompt_tokens * per_token / (PREFILL_ROWS * machine.compute_gbps_batched * 1e9)
    return max((b.disk_s, "disk"), (b.memory_s, "memory"), (compute, "compute"))


def plan(costs: ModelCosts, machine: Machine, *, context: int = 4096, batch: int = 1, tokens: int = 64,
         prompt_tokens: int = 1000, policy: str = "lru", recall: float = 0.0, trace: Trace | None = None,
         trace_name: str = "", seed: int = 0) -> Plan:
    placement = place(costs, machine, context, batch)
    if trace is None:
        trace = synthetic_trace(costs, 4 * tokens, seed)
        trace_name = ("synthetic: the temporal generator at the model's shape with its defaults "
                      f"({SynthSpec.__name__}: alpha {SynthSpec.alpha}, topic_sigma {SynthSpec.topic_sigma}, "
                      f"stickiness {SynthSpec.stickiness}); the routing locality is an assumption")
    sim = None
    if placement.fits:
        sim = simulate(trace, costs, machine.rates(), capacity=placement.experts_cached, policy=policy,
                       tokens=tokens, recall=recall)
    ttft, binding = prefill(costs, machine, prompt_tokens, seed)
    return Plan(costs, machine, placement, sim, ttft, binding, prompt_tokens, trace_name)
