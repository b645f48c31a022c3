"""Speculative decoding with an MTP head: draft k tokens, verify them in one step of k + 1 rows.

Legend: N = tokens a sequence has fed to the main model, k = drafts, D = hidden, V = vocab.

A generating sequence holds x_N (sampled, not yet fed) and drafts d_1..d_k for the positions
after it. One main step feeds [x_N, d_1, .., d_k] (positions N..N+k, row-invariant like any
chunk), and `verify` walks the k + 1 logits in order with the request's own Sampler: at
position N + i - 1 it chooses y_i (`Sampler.verify`: greedy, or rejection sampling against the
draft's distribution), stops at the first rejection or finish, and takes a bonus token from the
last logits when every draft was accepted. The main KV is then truncated to the accepted
positions (N + j + 1 for j accepted drafts). At temperature 0 every y_i is the token the
non-speculative decoder would have produced, bit for bit: the logits are the same numbers.

The MTP head (moetier/model/mtp.py, depth 0) keeps its own cache, one entry per position from
`first` on (entry e is position first + e). After a step it is fed teacher-forced rows: at
position p the token x_p and the main model's hidden state of position p - 1, for every
position whose predecessor the main model processed validly this step (`Feed`); the last row's
output drafts d_1, and chaining the same layer on its own output (its output as the hidden
state) drafts d_2..d_k. Chained entries are speculative: the next step truncates the MTP cache
to its teacher-forced entries before feeding more. A sequence whose earlier hidden states are
not known (a prefix-cache hit, drafting switched off for a while) restarts its MTP cache at
the first position it can feed: drafts then see a shorter context, which costs acceptance,
never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from moetier.model.kv_cache import KVCache
from moetier.model.mtp import MtpHead
from moetier.model.sampling import Probs, SampledToken, Sampler

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


class Matcher(Protocol):
    """A grammar matcher (moetier.text.grammar.GrammarMatcher): structured outputs."""

    def allowed(self) -> npt.NDArray[np.bool_]: ...

    def accept(self, token: int) -> None: ...


@dataclass
class DraftState:
    """One sequence's drafting state."""

    cache: KVCache  # MTP depth-0 cache; entry e is position `first + e`
    first: int = 1
    drafts: list[int] = field(default_factory=list)  # d_1..d_k for the next step
    q: list[Probs | None] = field(default_factory=list)  # their distributions (temperature > 0)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)  # draws drafts at T > 0

    def clear(self) -> None:
        self.drafts, self.q = [], []


@dataclass(frozen=True)
class Feed:
    """Teacher-forced MTP rows of one sequence: tokens at positions pos0 .. pos0 + n - 1 and the
    main model's final-normed hidden states of the positions before each."""

    tokens: I64  # [n]
    hidden: F32  # [n, D]
    pos0: int


@dataclass(frozen=True)
class Verified:
    tokens: list[SampledToken]  # y_1.. in order; the last may carry a finish reason
    reasons: list[str | None]
    accepted: int  # drafts accepted (<= len(tokens))


def verify(sampler: Sampler, logits: F32, drafts: Sequence[int], q: Sequence[Probs | None],
           finish: Callable[[SampledToken], str | None], matcher: Matcher | None = None) -> Verified:
    """Walk the logits [len(drafts) + 1, V] of one verify step in order (module docstring).
    `finish(token)` gives the finish reason after a token (None: go on). With a grammar
    `matcher`, each position is masked by the matcher after the tokens before it, and the
    matcher accepts every token chosen: a draft the grammar forbids is simply rejected."""
    out: list[SampledToken] = []
    reasons: list[str | None] = []
    accepted = 0
    for i in range(len(drafts) + 1):
        allowed = matcher.allowed() if matcher is not None else None
        if i < len(drafts):
            tok, ok = sampler.verify(logits[i], drafts[i], q[i], allowed)
        else:
            tok, ok = sampler.choose(logits[i], allowed), False  # every draft accepted: the bonus token
        if matcher is not None:
            matcher.accept(tok.token)
        accepted += ok
        reason = finish(tok)
        out.append(tok)
        reasons.append(reason)
        if reason is not None or not ok:
            break
    return Verified(out, reasons, accepted)


class Drafter:
    """Runs an MTP head for the sequences of a step: their teacher-forced rows in one MTP step,
    then the chained draft steps, each one MTP step over every sequence still drafting."""

    def __init__(self, head: MtpHead) -> None:
        self.head = head
        self.model = head.main

    def new_state(self, seed: int | None = None) -> DraftState:
        return DraftState(self.head.new_caches()[0], rng=np.random.default_rng(None if seed is None else [seed, 7]))

    def advance(self, items: Sequence[tuple[DraftState, Feed | None, Sampler, int]],
                matchers: Sequence[Matcher | None] | None = None) -> None:
        """Per sequence (state, its teacher rows of this step or None, its sampler, k drafts wanted),
        and a copy of its grammar matcher if it has one: feed the rows, then draft, each draft masked
        by the grammar after the drafts before it (the copy advances over them and is then dropped:
        a copy, since a matcher that consumed a stop token cannot always roll it back). A sequence
        without rows (or with k = 0) drafts nothing."""
        matcher_of = {id(it[0]): m for it, m in zip(items, matchers or [None] * len(items), strict=True)}
        feeding: list[tuple[DraftState, Feed]] = []
        for st, feed, _, _ in items:
            st.clear()
            if feed is None or len(feed.tokens) == 0:
                continue
            keep = feed.pos0 - st.first  # entries before the new rows
            if keep < 0 or keep > st.cache.length:  # earlier positions unknown: start over here
                st.first, keep = feed.pos0, 0
            st.cache.truncate(keep)
            feeding.append((st, feed))
        if not feeding:
            return
        outs = self.head.step(0, [(st.cache, f.tokens, f.hidden, f.pos0) for st, f in feeding])
        last = {id(st): o[-1:] for (st, _), o in zip(feeding, outs, strict=True)}  # [1, D] per sequence
        pos = {id(st): f.pos0 + len(f.tokens) for st, f in feeding}  # the next draft's position
        want = [(st, sampler, k) for st, feed, sampler, k in items if k > 0 and id(st) in last]
        for i in range(max((k for _, _, k in want), default=0)):
            active = [(st, sampler) for st, sampler, k in want if k > i]
            if i > 0:  # chain: the last draft at its position, the previous output as hidden state
                outs = self.head.step(0, [(st.cache, np.array([st.drafts[-1]], dtype=np.int64), last[id(st)],
                                           pos[id(st)] - 1) for st, _ in active])
                for (st, _), o in zip(active, outs, strict=True):
                    last[id(st)] = o
            logits = self.model.head(np.concatenate([last[id(st)] for st, _ in active]))  # [A, V]
            for (st, sampler), lg in zip(active, logits, strict=True):
                m = matcher_of.get(id(st))
                allowed = m.allowed() if m is not None else None
                if allowed is not None and not allowed.any():
                    continue  # the grammar admits nothing more: no further drafts
                token, q = sampler.draft(lg, st.drafts, st.rng, allowed)
                if m is not None:
                    m.accept(token)
                st.drafts.append(token)
                st.q.append(q)
                pos[id(st)] += 1
            want = [(st, sampler, k) for st, sampler, k in want if len(st.drafts) == i + 1]  # still drafting
