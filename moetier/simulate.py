"""The trace-driven simulator: decode at batch 1 replayed through the tier's own replacement
policy, each step timed by the performance model (moetier/perf.py, the bounds `bench e2e`
measures against).

    sim = simulate(trace, costs, rates, capacity=..., policy="lru", tokens=64)
    sim.cold, sim.warm   # Phase: hit rate, bytes read and touched per token, tok/s at the bound
                         # and with no overlap, the binding bound

The cache model is `moetier.store.sim`'s: `capacity` equal-size records; each (layer, ids)
entry of a trace is one acquire of the layer's union, all of whose experts are resident at once
(a union larger than the cache is taken in waves of `capacity`, as the tier does); a hit is a
demanded expert already resident. The policy objects are the tier's (`make_policy`), so its
decisions are the tier's. Cold: the first `tokens` steps from an empty cache. Warm: the same
number of steps after the whole trace has been replayed once (the cache as a long run leaves it).

Step time: `perf.step_bounds` of the step's missed and touched bytes. `bound_s` assumes every
read overlaps compute (the design's target); `serial_s` overlaps nothing; with a prefetch recall
r (the share of a layer's experts predicted in time, `bench e2e` measures it) the expected step
is max(bound, (1 - r) x disk + max(memory, compute)): the reads nobody predicted stall the layer.

Traces: recorded ones (`moetier.store.trace` files: the bench traces, a store's routing) whose
expert count matches the model, or the synthetic `temporal` generator at the model's shape when
none exists for it (its locality is an assumption, printed as such).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetier.perf import ModelCosts, Rates, step_bounds
from moetier.store.policy import make_policy
from moetier.store.trace import SynthSpec, Trace, temporal_trace
from moetier.weights.index import ExpertKey


@dataclass(frozen=True)
class Phase:
    tokens: int
    hit_rate: float
    missed_bytes: float  # per token, read from disk
    touched_bytes: float  # per token, experts of the unions + dense
    bound_s: float  # per token, reads overlapping compute
    serial_s: float  # per token, no overlap
    expected_s: float  # per token, the unpredicted reads stalling (recall given)
    disk_s: float
    memory_s: float
    compute_s: float

    @property
    def binding(self) -> str:
        return max((self.disk_s, "disk"), (self.memory_s, "memory"), (self.compute_s, "compute"))[1]

    @property
    def tok_s(self) -> float:
        """At the bound (full overlap)."""
        return 1.0 / self.bound_s if self.bound_s else 0.0

    @property
    def tok_s_serial(self) -> float:
        return 1.0 / self.serial_s if self.serial_s else 0.0

    @property
    def tok_s_expected(self) -> float:
        return 1.0 / self.expected_s if self.expected_s else 0.0


@dataclass(frozen=True)
class Simulation:
    cold: Phase
    warm: Phase
    capacity: int  # experts the cache holds
    policy: str
    recall: float


class _Cache:
    """Resident experts under a policy, with the tier's rules (see the module docstring)."""

    def __init__(self, policy: str, layers: list[int], n_experts: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache of {capacity} experts holds nothing")
        self.policy = make_policy(policy, layers, n_experts, capacity)
        self.capacity = capacity
        self.resident: set[ExpertKey] = set()

    def acquire(self, keys: list[ExpertKey]) -> int:
        """Misses of one layer call's union (taken in waves that fit)."""
        misses = 0
        for i in range(0, len(keys), self.capacity):
            wave = keys[i : i + self.capacity]
            group = set(wave)
            missing = []
            for k in wave:
                self.policy.record(k)
                if k not in self.resident:
                    missing.append(k)
            misses += len(missing)
            while len(self.resident) + len(missing) > self.capacity:
                v = self.policy.victim(group.__contains__)
                assert v is not None and v in self.resident, "policy offered a victim that is not resident"
                self.resident.discard(v)
                self.policy.remove(v)
            for k in missing:
                self.resident.add(k)
                self.policy.insert(k)
        return misses


def _phase(cache: _Cache, steps: Trace, costs: ModelCosts, rates: Rates, recall: float) -> Phase:
    hits = total = 0
    missed_b = touched_b = bound = serial = expected = disk = memory = compute = 0.0
    for step in steps:
        union = missed = 0
        for layer, ids in step:
            keys = [(layer, int(e)) for e in np.unique(ids)]
            m = cache.acquire(keys)
            union += len(keys)
            missed += m
        hits += union - missed
        total += union
        b = step_bounds(missed * costs.record_bytes, union * costs.record_bytes + costs.dense_step_bytes, rates)
        missed_b += b.missed_bytes
        touched_b += b.touched_bytes
        bound += b.bound_s
        serial += b.serial_s
        expected += max(b.bound_s, (1.0 - recall) * b.disk_s + max(b.memory_s, b.compute_s))
        disk += b.disk_s
        memory += b.memory_s
        compute += b.compute_s
    n = max(1, len(steps))
    return Phase(len(steps), hits / total if total else 0.0, missed_b / n, touched_b / n, bound / n, serial / n,
                 expected / n, disk / n, memory / n, compute / n)


def simulate(trace: Trace, costs: ModelCosts, rates: Rates, *, capacity: int, policy: str = "lru",
             tokens: int = 64, recall: float = 0.0) -> Simulation:
    """Cold and warm decode of `tokens` steps each (see the module docstring)."""
    if not 0.0 <= recall <= 1.0:
        raise ValueError(f"prefetch recall {recall} is not in [0, 1]")
    if len(trace) < 2 * tokens:
        raise ValueError(f"the trace has {len(trace)} steps; cold and warm phases of {tokens} tokens need "
                         f"{2 * tokens}")
    layers = sorted({layer for step in trace for layer, _ in step})
    cap = min(capacity, len(layers) * costs.n_experts)
    cache = _Cache(policy, layers, costs.n_experts, max(1, cap))
    cold = _phase(cache, trace[:tokens], costs, rates, recall)
    _phase(cache, trace[tokens:], costs, rates, recall)  # the rest of the trace: a long run's cache
    warm = _phase(cache, trace[len(trace) - tokens :], costs, rates, recall)
    return Simulation(cold, warm, cap, policy, recall)


def replay_requests(trace: Trace, costs: ModelCosts, rates: Rates, *, capacity: int, policy: str = "lru",
                    recall: float = 0.0, requests: int = 2, prompt_steps: int = 1) -> list[Phase]:
    """`bench e2e`'s trial: one request's trace (its first `prompt_steps` steps the prompt, then
    one step per decode token) sent `requests` times to one cache that starts empty. The prompt
    steps fill the cache untimed (TTFT is not a decode step); each request's decode steps are a
    Phase: the first cold, the next warm, as bench e2e reports them."""
    layers = sorted({layer for step in trace for layer, _ in step})
    cache = _Cache(policy, layers, costs.n_experts, max(1, min(capacity, len(layers) * costs.n_experts)))
    out = []
    for _ in range(requests):
        _phase(cache, trace[:prompt_steps], costs, rates, recall)
        out.append(_phase(cache, trace[prompt_steps:], costs, rates, recall))
    return out


def synthetic_trace(costs: ModelCosts, steps: int, seed: int = 0) -> Trace:
    """A batch-1 decode trace at the model's shape from the `temporal` generator with its
    documented defaults (moetier.store.trace.SynthSpec): the routing locality is its assumption."""
    spec = SynthSpec(layers=costs.moe_layers, n_experts=costs.n_experts, top_k=costs.top_k, batch=1, steps=steps)
    return temporal_trace(spec, seed=seed)
