"""Choosing the next token from logits: penalties, temperature, top-k, top-p, seeded sampling.

Legend: V = vocab, k = top_logprobs.

A chain of small functions, each testable alone:
    apply_penalties -> logits_to_probs -> sample          (greedy_token at temperature 0)
`Sampler` holds one request's state (its RNG and the counts of the tokens it generated) and
applies the chain per step. The same seed gives the same tokens for the same logits.

Logprobs are those of the model's own distribution, log_softmax(logits), before penalties,
temperature and truncation: what the model thinks, independent of how it was sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
Probs = npt.NDArray[np.float64]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: the model's eos tokens do not stop generation
    seed: int | None = None  # None: fresh entropy
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0 or self.top_logprobs < 0:
            raise ValueError("max_tokens and top_logprobs must be >= 0")


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float | None = None  # of `token`, when asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first


def apply_penalties(logits: F32, counts: npt.NDArray[np.int64], presence: float, frequency: float) -> F32:
    """OpenAI penalties: logits - frequency * count - presence * (count > 0); logits/counts [V]."""
    if presence == 0 and frequency == 0:
        return logits
    penalty = frequency * counts + presence * (counts > 0)
    return (logits - penalty).astype(np.float32)


def log_softmax(logits: F32) -> F32:
    z = logits.astype(np.float64) - logits.max()
    return (z - np.log(np.exp(z).sum())).astype(np.float32)


def greedy_token(logits: F32) -> int:
    """The most likely token (lowest id on ties)."""
    return int(np.argmax(logits))


def logits_to_probs(logits: F32, temperature: float, top_k: int = 0, top_p: float = 1.0) -> npt.NDArray[np.float64]:
    """Temperature, then keep the top_k best, then the smallest best set with mass >= top_p: [V]."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")  # best first, lower id on ties
    if 0 < top_k < len(z):
        z[order[top_k:]] = -np.inf
        order = order[:top_k]
    p = np.exp(z - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, top_p)) + 1  # first prefix reaching top_p
        p[order[keep:]] = 0.0
        p /= p.sum()
    return p


def sample(probs: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """One draw by inverse CDF (one uniform per token, so a seed fixes the whole sequence)."""
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    nz = np.flatnonzero(probs)
    return int(min(max(i, nz[0]), nz[-1]))


class Sampler:
    """One request's sampling state."""

    def __init__(self, params: SamplingParams, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.generated = 0
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))

    def choose(self, logits: F32, allowed: npt.NDArray[np.bool_] | None = None) -> SampledToken:
        """Pick the next token from logits [V] and remember it. `allowed` [V] (a grammar's
        token mask): only those tokens may be chosen (at least one must be True)."""
        p = self.params
        penalised = self._penalised(logits, self.counts, allowed)
        if p.temperature == 0:
            token = greedy_token(penalised)
        else:
            token = sample(logits_to_probs(penalised, p.temperature, p.top_k, p.top_p), self.rng)
        return self._record(token, logits)

    def _penalised(self, logits: F32, counts: npt.NDArray[np.int64], allowed: npt.NDArray[np.bool_] | None) -> F32:
        p = self.params
        penalised = apply_penalties(logits, counts, p.presence_penalty, p.frequency_penalty)
        if allowed is not None:
            penalised = np.where(allowed, penalised, np.float32(-np.inf)).astype(np.float32)
        return penalised

    def _record(self, token: int, logits: F32) -> SampledToken:
        p = self.params
        self.counts[token] += 1
        self.generated += 1
        if not (p.logprobs or p.top_logprobs):
            return SampledToken(token)
        lp = log_softmax(logits)
        best = np.argsort(-lp, kind="stable")[: p.top_logprobs]
        return SampledToken(token, float(lp[token]), [(int(i), float(lp[i])) for i in best])

    # ---- speculative decoding (moetier/model/speculative.py) ---------------------------
    def draft(self, logits: F32, drafted: Sequence[int], rng: np.random.Generator,
              allowed: npt.NDArray[np.bool_] | None = None) -> tuple[int, Probs | None]:
        """A draft token for the position after `drafted` (this request's earlier drafts of the
        step), from draft logits [V] processed as `choose` would (penalties counting the drafts
        too, `allowed` the grammar's mask after them): greedy at temperature 0 (no distribution),
        else sampled with `rng` from the distribution q returned with it, which `verify` needs."""
        p = self.params
        counts = self.counts.copy()
        for t in drafted:
            counts[t] += 1
        penalised = self._penalised(logits, counts, allowed)
        if p.temperature == 0:
            return greedy_token(penalised), None
        q = logits_to_probs(penalised, p.temperature, p.top_k, p.top_p)
        return sample(q, rng), q

    def verify(self, logits: F32, draft: int, q: Probs | None,
               allowed: npt.NDArray[np.bool_] | None = None) -> tuple[SampledToken, bool]:
        """Choose the token at a position a draft was made for, from the target logits [V] (and
        the grammar's mask `allowed`), and remember it; True when it is the draft (accepted).
        Temperature 0: the greedy token, so the output is exactly `choose`'s. Otherwise standard
        speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept with
        probability min(1, p(d) / q(d)), else draw from max(p - q, 0) renormalised; the token is
        then distributed as p, the distribution `choose` samples from."""
        params = self.params
        penalised = self._penalised(logits, self.counts, allowed)
        if params.temperature == 0:
            token = greedy_token(penalised)
            return self._record(token, logits), token == draft
        if q is None:
            raise ValueError("verify at temperature > 0 needs the draft's distribution q")
        p = logits_to_probs(penalised, params.temperature, params.top_k, params.top_p)
        u = self.rng.random()
        if q[draft] > 0 and u * q[draft] < p[draft]:  # u < p(d) / q(d)
            return self._record(draft, logits), True
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        token = sample(residual / total if total > 0 else p, self.rng)
        return self._record(token, logits), False

    def finish_reason(self, token: int) -> str | None:
        """"stop" after a stop/eos token, "length" at max_tokens, else None."""
        if token in self.stop_ids:
            return "stop"
        if self.generated >= self.params.max_tokens:
            return "length"
        return None
