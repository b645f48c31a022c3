"""Routing traces: which experts each MoE layer of each decode step needed.

A trace is a list of steps; a step is a list of (layer, ids) in execution order,
`ids` being the expert ids the layer's batch routed to (any shape, typically the
[T, K] top-k ids or their union; only the set matters to a cache).

File format (`.npz`, no pickle):
    format   "moetier-trace-1"
    n_experts  scalar int
    step     int32 [N]     step of each entry (non-decreasing)
    layer    int32 [N]
    offsets  int64 [N + 1] entry n's ids are ids[offsets[n]:offsets[n + 1]]
    ids      int32 [M]

Synthetic generators, for when no model trace is at hand:
    zipf      every token picks top-k distinct experts with Zipf(alpha) popularity
              per layer (a random rank order per layer), independently.
    temporal  the same, plus what real routing shows: each sequence of the batch has
              its own topic (a log-normal tilt of the popularity), consecutive tokens
              of a sequence tend to reuse their previous experts (stickiness), and
              sequences end and are replaced (churn), so the hot set drifts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError

Ids = npt.NDArray[np.int32]
Step = list[tuple[int, Ids]]
Trace = list[Step]
FORMAT = "moetier-trace-1"


def save_trace(path: Path | str, trace: Trace, n_experts: int) -> None:
    steps, layers, offsets, ids = [], [], [0], []
    for s, step in enumerate(trace):
        for layer, e in step:
            flat = np.asarray(e, dtype=np.int32).reshape(-1)
            steps.append(s)
            layers.append(layer)
            ids.append(flat)
            offsets.append(offsets[-1] + flat.size)
    np.savez_compressed(
        path, format=np.array(FORMAT), n_experts=np.array(n_experts, dtype=np.int64),
        step=np.array(steps, dtype=np.int32), layer=np.array(layers, dtype=np.int32),
        offsets=np.array(offsets, dtype=np.int64),
        ids=np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32),
    )


def load_trace(path: Path | str) -> tuple[Trace, int]:
    """(trace, n_experts)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) != FORMAT:
                raise FormatError(f"{path}: not a moetier trace (format {z['format']!s})")
            n_experts = int(z["n_experts"])
            step, layer, offsets, ids = z["step"], z["layer"], z["offsets"], z["ids"]
    except (OSError, KeyError, ValueError) as e:
        raise FormatError(f"{path}: cannot read trace ({e})") from e
    if offsets.size != step.size + 1 or layer.size != step.size or offsets[-1] != ids.size:
        raise FormatError(f"{path}: inconsistent trace arrays")
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise FormatError(f"{path}: expert ids outside 0..{n_experts - 1}")
    trace: Trace = []
    for n in range(step.size):
        while len(trace) <= int(step[n]):
            trace.append([])
        trace[int(step[n])].append((int(layer[n]), ids[offsets[n]:offsets[n + 1]].astype(np.int32)))
    return trace, n_experts


@dataclass(frozen=True)
class SynthSpec:
    layers: int = 16
    n_experts: int = 128
    top_k: int = 8
    batch: int = 4  # tokens per decode step (one per running sequence)
    steps: int = 1000
    alpha: float = 0.8  # Zipf exponent of per-layer popularity
    topic_sigma: float = 1.0  # temporal: log-normal tilt of a sequence's popularity
    stickiness: float = 1.5  # temporal: logit bonus of a sequence's previous experts
    mean_seq_len: float = 200.0  # temporal: decode steps per sequence (geometric)


def _popularity(rng: np.random.Generator, spec: SynthSpec) -> npt.NDArray[np.float64]:
    ranks = np.arange(1, spec.n_experts + 1, dtype=np.float64)
    p = ranks ** -spec.alpha
    out = np.stack([rng.permutation(p) for _ in range(spec.layers)])  # [L, E]
    return np.log(out / out.sum(axis=1, keepdims=True))


def _topk(logits: npt.NDArray[np.float64], k: int, rng: np.random.Generator) -> Ids:
    """Gumbel top-k: k distinct ids sampled without replacement by softmax(logits), per row."""
    g = logits + rng.gumbel(size=logits.shape)
    return np.argpartition(-g, k - 1, axis=-1)[..., :k].astype(np.int32)


def zipf_trace(spec: SynthSpec, seed: int = 0, model_seed: int = 0) -> Trace:
    """model_seed fixes the per-layer popularity (the model); seed the traffic."""
    logp = _popularity(np.random.default_rng(model_seed), spec)
    rng = np.random.default_rng(seed)
    return [
        [(layer, _topk(np.broadcast_to(logp[layer], (spec.batch, spec.n_experts)), spec.top_k, rng))
         for layer in range(spec.layers)]
        for _ in range(spec.steps)
    ]


def temporal_trace(spec: SynthSpec, seed: int = 0, model_seed: int = 0) -> Trace:
    """model_seed fixes the per-layer popularity (the model); seed the traffic."""
    logp = _popularity(np.random.default_rng(model_seed), spec)  # [L, E]
    rng = np.random.default_rng(seed)
    b, e = spec.batch, spec.n_experts

    def topic() -> npt.NDArray[np.float64]:
        return logp + spec.topic_sigma * rng.standard_normal(logp.shape)  # [L, E]

    topics = [topic() for _ in range(b)]
    prev: list[list[Ids | None]] = [[None] * spec.layers for _ in range(b)]
    trace: Trace = []
    for _ in range(spec.steps):
        for s in range(b):
            if rng.random() < 1.0 / spec.mean_seq_len:  # sequence s finished; a new one starts
                topics[s] = topic()
                prev[s] = [None] * spec.layers
        step: Step = []
        for layer in range(spec.layers):
            logits = np.stack([topics[s][layer] for s in range(b)])  # [B, E]
            for s in range(b):
                p = prev[s][layer]
                if p is not None:
                    logits[s, p] += spec.stickiness
            ids = _topk(logits, spec.top_k, rng)  # [B, K]
            for s in range(b):
                prev[s][layer] = ids[s]
            step.append((layer, ids))
        trace.append(step)
    assert all(ids.max() < e for st in trace for _, ids in st)
    return trace


def trace_stats(trace: Trace) -> dict[str, float]:
    """Accesses (expert uses after the per-layer batch union) and mean union size."""
    sizes = [np.unique(ids).size for step in trace for _, ids in step]
    return {"steps": len(trace), "layer_calls": len(sizes), "accesses": float(sum(sizes)),
            "mean_union": float(np.mean(sizes)) if sizes else 0.0}


class TraceRecorder:
    """An ExpertProvider wrapper that records every `moe` call's routing as a trace (a new step
    starts when the layer order wraps), then delegates: `Model(..., TraceRecorder(experts))`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trace: Trace = []
        self._last = -1

    def moe(self, layer: int, x: npt.NDArray[np.float32], ids: Ids, weights: npt.NDArray[np.float32]) -> Any:
        if not self.trace or layer <= self._last:
            self.trace.append([])
        self.trace[-1].append((layer, np.array(ids, dtype=np.int32)))
        self._last = layer
        return self.inner.moe(layer, x, ids, weights)

    def prefetch(self, layer: int, ids: Ids) -> None:
        self.inner.prefetch(layer, ids)
