"""When speculative decoding pays: the per-step controller of the drafts per sequence.

Drafting k tokens per sequence turns a decode step of R rows into one of R + k S rows (S the
sequences drafting). On a memory- or disk-bound MoE that costs little for the dense part, but the
verify rows route to experts of their own: the batch union widens, and every extra expert that
is not in RAM is a disk read. (The seed's users found MTP a net loss when disk-bound: 28-52%
acceptance, 1.8-2.6 tokens per forward, decode 32% slower on one machine.) The controller
weighs, from the worker's own measurements, the expected tokens of a step against its expected
time, and picks the k in 0..k_max that gives the most tokens per second; 0 turns drafting off.

Measured, per step (`observe_step`): its seconds split into dense (attention, gates, norms, the
lm_head: grows with rows), routed experts (grows with the union and with the misses in it) and
the MTP head's own steps; its rows, the union of experts over its MoE layers and the misses in
that union. Per verify (`observe_verify`): drafts made and accepted at each draft position.

Model, refit at every decision from the last WINDOW steps (ridge least squares, coefficients
kept >= 0):
    dense(R)        = d0 + d1 R
    experts(U, M)   = e0 + e1 U + e2 M
    union(R)        = L E (1 - (1 - K/E)^(c R))     c fitted from the observed unions
    misses(U)       = m U                           m the observed miss share of the union
    mtp(k)          = k s                           s seconds per MTP step (1 + (k - 1) chained)
    tokens(k)       = S (1 + sum_{i<=k} prod_{j<=i} a_j)   a_j: acceptance at draft position j
    k*              = argmax_k tokens(k) / (dense(R0 + k S) + experts(U(k), M(k)) + mtp(k))
Before it has seen both settings it alternates k = 0 and 1; after, every PROBE_EVERY steps at
a k* below k_max it tries k* + 1 (k = 1 while off), so the acceptance of later draft positions
and the cost of wider steps stay measured rather than assumed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.model.forward import Model
from moetier.model.generate import GeneratedToken
from moetier.model.kv_cache import KVCache
from moetier.model.ops import MoeCall, start_moe
from moetier.model.sampling import Sampler, SamplingParams
from moetier.model.speculative import Drafter, Feed, verify

F32 = npt.NDArray[np.float32]

WINDOW = 64  # steps the cost fit looks back over
PROBE_EVERY = 32  # steps between probes of k* + 1 while the cost model keeps k* below k_max
MIN_STEPS = 6  # steps of each kind (with and without drafts) before the model decides
PRIOR_ACCEPTANCE = 0.5  # per draft position, before any draft was verified
ACCEPT_DECAY = 0.98  # weight of the past in the acceptance averages
Reason = str  # "disabled" | "no_mtp" | "cost" | "measuring" | "no_room" (a bounded label)


@dataclass(frozen=True)
class StepCost:
    rows: int  # rows of the step (verify rows included)
    sequences: int  # sequences that drafted for it (S)
    drafts: int  # draft rows it verified (k S)
    dense_s: float  # attention, gates, norms, lm_head, sampling
    experts_s: float  # routed experts (provider calls)
    mtp_s: float  # the MTP head's steps after it
    mtp_steps: int
    union: int  # experts in the batch union, summed over MoE layers
    misses: int  # of those, not resident (read from disk)


@dataclass
class Decision:
    k: int
    reason: Reason | None = None  # why k == 0
    expected_tokens_per_s: dict[int, float] = field(default_factory=dict)  # per candidate k (when modelled)

    @property
    def feed(self) -> bool:
        """Whether the MTP head keeps following the sequence (its teacher-forced rows) this step:
        when drafting, and while measuring; off for cost it rests (its cache restarts later)."""
        return self.k > 0 or self.reason == "measuring"


class Controller:
    """Chooses the drafts per sequence of the next step. Pure bookkeeping: no clocks of its own."""

    def __init__(self, k_max: int, *, moe_layers: int, experts: int, top_k: int, has_mtp: bool = True,
                 fixed: bool = False) -> None:
        """fixed: always draft k_max (benchmarks, tests); else the cost model decides."""
        if k_max < 0:
            raise ValueError(f"speculative k must be >= 0, got {k_max}")
        self.k_max = k_max
        self.fixed = fixed
        self.moe_layers, self.experts, self.top_k = moe_layers, experts, top_k
        self.has_mtp = has_mtp
        # steps with and without drafts, kept apart so that neither kind falls out of the fit
        self._plain: deque[StepCost] = deque(maxlen=WINDOW // 2)
        self._drafted: deque[StepCost] = deque(maxlen=WINDOW // 2)
        self.acceptance = np.full(max(k_max, 1), PRIOR_ACCEPTANCE)  # a_j per draft position
        self._weight = np.zeros(max(k_max, 1))
        self.drafted = np.zeros(max(k_max, 1), dtype=np.int64)  # totals per position (metrics)
        self.accepted = np.zeros(max(k_max, 1), dtype=np.int64)
        self._since_probe = 0
        self.last = Decision(0, "disabled")

    # ---- observations ----------------------------------------------------------------
    def observe_step(self, cost: StepCost) -> None:
        (self._drafted if cost.drafts else self._plain).append(cost)

    @property
    def steps(self) -> list[StepCost]:
        return [*self._plain, *self._drafted]

    def observe_verify(self, drafted: int, accepted: int) -> None:
        """One sequence's verify: `drafted` drafts, the first `accepted` of them accepted."""
        for j in range(min(drafted, len(self.acceptance))):
            ok = j < accepted
            self.drafted[j] += 1
            self.accepted[j] += ok
            w = self._weight[j] * ACCEPT_DECAY
            self.acceptance[j] = (self.acceptance[j] * w + ok) / (w + 1)
            self._weight[j] = w + 1
            if not ok:
                break

    # ---- the decision ------------------------------------------------------------------
    def decide(self, decode_rows: int, other_rows: int) -> Decision:
        """k for the next step, with `decode_rows` sequences generating and `other_rows` prompt rows."""
        if self.k_max == 0:
            return self._set(Decision(0, "disabled"))
        if not self.has_mtp:
            return self._set(Decision(0, "no_mtp"))
        if self.fixed:
            return self._set(Decision(self.k_max))
        if len(self._drafted) < MIN_STEPS or len(self._plain) < MIN_STEPS:
            # measuring: alternate until both kinds of step have been seen
            even = (len(self._drafted) + len(self._plain)) % 2 == 0
            return self._set(Decision(1, None) if even else Decision(0, "measuring"))
        fit = self.fit()
        rates = {k: fit.tokens_per_s(k, decode_rows, other_rows) for k in range(self.k_max + 1)}
        best = max(rates, key=lambda k: (rates[k], -k))
        if best < self.k_max:
            # probe one draft more now and then: the acceptance of a position never drafted stays
            # at its prior, and the cost of wider steps unmeasured, unless it is tried
            self._since_probe += 1
            if self._since_probe >= PROBE_EVERY:
                self._since_probe = 0
                return self._set(Decision(best + 1, None, rates))
        if best == 0:
            return self._set(Decision(0, "cost", rates))
        return self._set(Decision(best, None, rates))

    def _set(self, d: Decision) -> Decision:
        self.last = d
        return d

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence emits per step with k drafts: 1 + sum_i prod_{j<=i} a_j."""
        return 1.0 + float(np.sum(np.cumprod(self.acceptance[:k]))) if k else 1.0

    # ---- the cost model --------------------------------------------------------------
    def fit(self) -> CostModel:
        """The cost model fitted to the steps in the window (module docstring)."""
        steps = self.steps
        dense = _fit([[1.0, s.rows] for s in steps], [s.dense_s for s in steps]) if steps else np.zeros(2)
        experts = (_fit([[1.0, s.union, s.misses] for s in steps], [s.experts_s for s in steps]) if steps
                   else np.zeros(3))
        mtp = [s.mtp_s / s.mtp_steps for s in steps if s.mtp_steps]
        u = sum(s.union for s in steps)
        return CostModel(self, dense, experts, _correlation(steps, self.moe_layers, self.experts, self.top_k),
                         sum(s.misses for s in steps) / u if u else 0.0, float(np.median(mtp)) if mtp else 0.0)


@dataclass(frozen=True)
class CostModel:
    ctl: Controller
    dense: np.ndarray  # d0, d1
    experts: np.ndarray  # e0, e1, e2
    correlation: float  # c
    miss_share: float  # m
    mtp_step_s: float  # s

    def union(self, rows: int) -> float:
        """Expected experts in the union over the MoE layers for `rows` rows."""
        e, k, layers = self.ctl.experts, self.ctl.top_k, self.ctl.moe_layers
        if e == 0 or layers == 0:
            return 0.0
        return layers * e * (1.0 - (1.0 - k / e) ** (self.correlation * rows))

    def step_seconds(self, rows: int, k: int) -> float:
        """Expected seconds of a step of `rows` rows whose sequences drafted k tokens each."""
        u = self.union(rows)
        d, e = self.dense, self.experts
        return float(d[0] + d[1] * rows + e[0] + e[1] * u + e[2] * u * self.miss_share + k * self.mtp_step_s)

    def tokens_per_s(self, k: int, decode_rows: int, other_rows: int) -> float:
        s = max(decode_rows, 1)
        t = self.step_seconds(other_rows + s * (1 + k), k)
        return s * self.ctl.expected_tokens(k) / t if t > 0 else 0.0


def _correlation(steps: list[StepCost], layers: int, e: int, k: int) -> float:
    """c: rows' routing is as spread as c R independent rows' (1: independent; < 1: shared experts)."""
    est = []
    for s in steps:
        per_layer = s.union / max(layers, 1)
        if 0 < per_layer < e and s.rows > 0 and 0 < k < e:
            est.append(np.log(1 - per_layer / e) / (s.rows * np.log(1 - k / e)))
    return float(np.clip(np.median(est), 0.05, 1.0)) if est else 1.0


def _fit(x: list[list[float]], y: list[float], ridge: float = 1e-6) -> np.ndarray:
    """Least squares y ~ x with a little ridge (features often move together), coefficients >= 0."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    an = a / scale
    coef = np.linalg.solve(an.T @ an + ridge * len(b) * np.eye(an.shape[1]), an.T @ b) / scale
    if (coef < 0).any():  # refit without the features that came out negative
        keep = coef > 0
        coef = np.zeros_like(coef)
        if keep.any():
            sub = an[:, keep]
            coef[keep] = np.linalg.solve(sub.T @ sub + ridge * len(b) * np.eye(sub.shape[1]), sub.T @ b) / scale[keep]
            coef = np.maximum(coef, 0.0)
    return coef


# ---- the single-sequence speculative decoder (the in-process engine) --------------------------
class ClockedExperts:
    """An ExpertProvider that times its calls (the routed-experts share of a step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def moe(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> F32:
        t0 = time.perf_counter()
        try:
            y: F32 = self.inner.moe(layer, x, ids, weights)
            return y
        finally:
            self.seconds += time.perf_counter() - t0

    def moe_start(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> MoeCall:
        """The inner provider's call under way (its reads overlap the shared expert), timed from
        its start to its result; a provider without `moe_start` computes here and now."""
        t0 = time.perf_counter()
        try:
            call = start_moe(self.inner, layer, x, ids, weights)
        finally:
            self.seconds += time.perf_counter() - t0
        return _ClockedCall(self, call, time.perf_counter())

    def prefetch(self, layer: int, ids: npt.NDArray[np.int32]) -> None:
        self.inner.prefetch(layer, ids)


class _ClockedCall:
    def __init__(self, clock: ClockedExperts, call: MoeCall, t0: float) -> None:
        self._clock, self._call, self._t0 = clock, call, t0

    def result(self) -> F32:
        try:
            return self._call.result()
        finally:
            self._clock.seconds += time.perf_counter() - self._t0

    def abandon(self) -> None:
        self._call.abandon()


@dataclass
class SpecStats:
    """What speculation did (metrics, benchmarks): totals since the start."""

    steps: int = 0  # main-model forwards while generating
    emitted: int = 0  # tokens they produced
    drafted: int = 0
    accepted: int = 0
    off: dict[str, int] = field(default_factory=dict)  # steps without drafts, by reason
    k_chosen: dict[int, int] = field(default_factory=dict)  # steps by k

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def generate_speculative(model: Model, drafter: Drafter, controller: Controller, prompt: npt.NDArray[np.int64],
                         params: SamplingParams, cache: KVCache | None = None, *,
                         misses: Callable[[], int] | None = None, stats: SpecStats | None = None,
                         chunk_size: int | None = None) -> Iterator[GeneratedToken]:
    """`moetier.model.generate.generate` with MTP drafts verified one step at a time: the same
    tokens at temperature 0, the same distribution above it. `misses()`: the expert tier's
    misses so far (the cost model's disk term); `stats` is updated as it goes."""
    if params.max_tokens == 0:
        return
    cache = cache if cache is not None else model.new_cache()
    cache.expect(max(cache.expected, cache.length + len(prompt) + params.max_tokens))  # the most it may reach
    stats = stats if stats is not None else SpecStats()
    sampler = Sampler(params, model.args.vocab_size, model.args.eos_token_ids)
    state = drafter.new_state(params.seed)
    allowed = may_draft(params, controller)
    limit = model.args.max_position_embeddings
    clocked = ClockedExperts(model.experts)
    model.experts, restore = clocked, model.experts
    try:
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        step = chunk_size or len(ids)
        hidden: list[F32] = []
        start = cache.length
        for i in range(0, len(ids), step):
            hidden.append(model.forward([(cache, ids[i : i + step])])[0])  # [n, D]
        h = np.concatenate(hidden)
        tok = sampler.choose(model.head(h[-1:])[0])
        reason = sampler.finish_reason(tok.token)
        d = controller.decide(1, 0) if reason is None else Decision(0, "no_room")
        k = _room(d.k, sampler, params, cache.length, limit) if allowed else 0
        tokens = np.concatenate([ids[1:], [tok.token]]).astype(np.int64)
        drafter.advance([(state, Feed(tokens, h, start + 1) if d.feed else None, sampler, k)])
        while True:
            yield GeneratedToken(tok.token, reason, tok.logprob, tok.top_logprobs)
            if reason is not None:
                return
            drafts, q = list(state.drafts), list(state.q)
            stats.k_chosen[len(drafts)] = stats.k_chosen.get(len(drafts), 0) + 1
            if not drafts:
                r = d.reason or "no_room"
                stats.off[r] = stats.off.get(r, 0) + 1
            n = cache.length
            u0, m0, e0 = model.stats.prefetch.actual, misses() if misses else 0, clocked.seconds
            t0 = time.perf_counter()
            h = model.forward([(cache, np.array([tok.token, *drafts], dtype=np.int64))])[0]  # [k+1, D]
            logits = model.head(h)
            t1 = time.perf_counter()
            v = verify(sampler, logits, drafts, q, lambda t: sampler.finish_reason(t.token))
            cache.truncate(n + v.accepted + 1)
            controller.observe_verify(len(drafts), v.accepted)
            stats.steps += 1
            stats.emitted += len(v.tokens)
            stats.drafted += len(drafts)
            stats.accepted += v.accepted
            for t, why in zip(v.tokens[:-1], v.reasons[:-1], strict=True):
                yield GeneratedToken(t.token, why, t.logprob, t.top_logprobs)
            tok, reason = v.tokens[-1], v.reasons[-1]
            if reason is None:
                d = controller.decide(1, 0)
                k = _room(d.k, sampler, params, cache.length, limit) if allowed else 0
                feed = Feed(np.array([t.token for t in v.tokens], dtype=np.int64), h[: len(v.tokens)], n + 1)
                m0s = time.perf_counter()
                drafter.advance([(state, feed if d.feed else None, sampler, k)])
                mtp_s = time.perf_counter() - m0s if d.feed else 0.0
            else:
                mtp_s, k = 0.0, 0
            experts_s = clocked.seconds - e0
            controller.observe_step(StepCost(
                rows=len(drafts) + 1, sequences=1 if drafts else 0, drafts=len(drafts),
                dense_s=max(t1 - t0 - experts_s, 0.0), experts_s=experts_s, mtp_s=mtp_s,
                mtp_steps=max(k, 1) if mtp_s else 0, union=model.stats.prefetch.actual - u0,
                misses=(misses() - m0) if misses else 0))
    finally:
        model.experts = restore


def may_draft(params: SamplingParams, controller: Controller) -> bool:
    """Whether a request is drafted for. A seeded request sampled at temperature > 0 is not,
    unless the drafts per step are fixed: rejection sampling keeps its distribution, but which
    tokens a seed gives would then depend on how many drafts the cost model chose, a matter of
    timing; undrafted, the same seed gives the same tokens, as without speculation."""
    return controller.fixed or params.temperature == 0 or params.seed is None


def _room(k: int, sampler: Sampler, params: SamplingParams, fed: int, limit: int) -> int:
    """Drafts worth making: none past max_tokens (the last token needs no draft) or the positions."""
    return max(0, min(k, params.max_tokens - sampler.generated - 1, limit - fed - 2))
