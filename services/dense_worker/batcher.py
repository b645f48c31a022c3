"""Continuous batching: one asyncio loop deciding what each step holds, one thread running it.

    seq = batcher.submit(request)          # ResourceExhausted when the queues are full
    async for out in seq.outputs(): ...    # one Output per generated token; errors raise
    batcher.release(seq)                   # the caller is done or gone (cancels if running)

Admission counts what the callers still want: a sequence whose caller has gone stops
counting against max_batch + max_waiting at once (a waiting one leaves the queue, a running
one is marked leaving), although a running one keeps its KV until the next step boundary.
The router hands a cancelled request's slot on immediately, so the next call may arrive
before that boundary and must not be refused.

The loop, at every step boundary:
  1. drops cancelled sequences (their KV is freed here) and admits waiting requests into
     the running batch, oldest first, up to max_batch;
  2. hands the batch to the step thread, which
       - looks up the prompt of each newly admitted sequence in the prefix cache (a hit
         starts its KV with the cached blocks and skips their prefill),
       - plans the rows: one decode token per generating sequence, and prompt chunks of
         the prefilling ones, oldest first, at most `prefill_chunk` prompt tokens per step
         in all (a long prompt is prefilled over several steps, interleaved with decoding),
       - runs `Model.step` on all rows (one ComputeExperts call per MoE layer, the batch
         union), then samples each sequence whose prompt is complete with its own Sampler;
         sequences with a grammar (structured outputs) first get their token masks, all
         in one parallel call, and their matchers advance by the sampled token,
       - stores the KV of every sequence that finished in the prefix cache;
       - with an MTP head (speculative decoding, moetier/model/speculative.py): a generating
         sequence's rows are its next token and the drafts made for it; `verify` walks their
         logits with its Sampler (and grammar matcher), its KV is truncated to what was
         accepted, and it may emit several tokens. The head then follows every sequence of
         the step (its teacher-forced rows, one MTP step for all) and drafts for the next
         step as many tokens per sequence as `moetier.speculation.Controller` finds pay;
  3. streams the tokens to their callers and retires finished sequences.
A step that fails (expert store down or slow past its deadline) fails the sequences in
it with that error; the others carry on. Where the expert provider names the rows it could not
compute (sharded stores: experts with no live owner, `RowsUnavailable`), only those rows'
sequences fail, and the rest are stepped again (a failed forward commits no KV). The kernels are row-invariant, so neither the
batch a sequence shares nor how its prompt was chunked changes a bit of its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument, ResourceExhausted, RowsUnavailable, Unavailable
from moetier.model.forward import Model
from moetier.model.kv_cache import KVCache
from moetier.model.sampling import SampledToken, Sampler, SamplingParams
from moetier.model.speculative import Drafter, DraftState, Feed, verify
from moetier.prefix_cache import PrefixCache
from moetier.speculation import Controller, Decision, StepCost, may_draft
from moetier.text.grammar import GrammarCompiler, GrammarMatcher, fill_masks
from services.dense_worker.metrics import StepReport, WorkerMetrics
from services.dense_worker.timing import PhaseClock

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]


class Stepper(Protocol):
    """The expert provider's step counter (RemoteExperts)."""

    def new_step(self) -> int: ...


@dataclass(frozen=True)
class Limits:
    max_batch: int
    max_waiting: int
    max_seq_len: int  # prompt + generated tokens per sequence
    prefill_chunk: int  # prompt tokens prefilled per step, all sequences together
    vocab_size: int


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: I64  # [P]
    params: SamplingParams  # stop_token_ids are the request's; ignore_eos is set (the caller chose)
    grammar: str | None = None  # llguidance grammar the generated tokens must match (structured outputs)
    received: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class StepTimings:
    step_s: float
    attention_s: float
    gate_s: float
    expert_s: float
    sampling_s: float
    rows: int
    mask_s: float = 0.0  # grammar masks: computing and applying them (part of sampling_s)


@dataclass(frozen=True)
class Output:
    """One generated token for the caller; the first carries the request's prompt figures."""

    token: SampledToken
    finish_reason: str | None
    timings: StepTimings
    first: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0


class Sequence:
    def __init__(self, request: Request, vocab_size: int, matcher: GrammarMatcher | None = None) -> None:
        self.request = request
        self.sampler = Sampler(request.params, vocab_size)
        self.matcher = matcher  # owned by the step thread once admitted
        self._queue: asyncio.Queue[Output | BaseException] = asyncio.Queue()
        self.cancelled = False
        self.finished = False
        # owned by the step thread while a step runs, by the loop between steps
        self.cache: KVCache | None = None
        self.fed = 0  # prompt tokens in the cache
        self.cached = 0  # of those, from the prefix cache
        self.next_token: int | None = None  # sampled, not yet fed
        self.draft: DraftState | None = None  # the MTP head's state (speculative decoding)
        self.first_step_at: float | None = None
        self.emitted = 0
        self.last_token_at = 0.0

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt)

    async def outputs(self) -> AsyncIterator[Output]:
        """Tokens until the one with a finish_reason; raises the error that ended the sequence."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _put(self, item: Output | BaseException) -> None:
        self._queue.put_nowait(item)


@dataclass
class _Result:
    rows: list[tuple[Sequence, I64]]
    sampled: list[tuple[Sequence, SampledToken, str | None]]
    lookups: list[tuple[int, int]]  # (query tokens, hit tokens) of the prefix cache lookups
    timings: StepTimings
    error: BaseException | None = None
    prefetch: tuple[int, int, int] = (0, 0, 0)
    verified: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verifying sequence
    decision: Decision | None = None  # the controller's choice for the next step
    decoding: set[int] = field(default_factory=set)  # id() of the sequences whose rows were decode rows


class Batcher:
    def __init__(self, model: Model, experts: Stepper, prefix: PrefixCache | None, clock: PhaseClock,
                 metrics: WorkerMetrics, limits: Limits, after_step: Callable[[], None] | None = None,
                 grammars: GrammarCompiler | None = None, drafter: Drafter | None = None,
                 controller: Controller | None = None) -> None:
        self.model = model
        self.drafter = drafter  # None: no MTP head or speculation off
        self.controller = controller
        self.grammars = grammars  # None: the model has no tokenizer, structured outputs are refused
        self.experts = experts
        self.prefix = prefix
        self.clock = clock
        self.metrics = metrics
        self.limits = limits
        self._after_step = after_step  # e.g. bring metrics counted elsewhere up to date
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-worker-step")
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._mean_step_s = 0.05
        self.kv_bytes = 0
        pf = model.stats.prefetch
        self._prefetch_seen = (pf.predicted, pf.actual, pf.hits)
        metrics.observe_state(lambda: self.running, lambda: len(self._waiting), lambda: self.kv_bytes,
                              limits.max_batch)

    # ---- the request side (event loop) -------------------------------------------------
    @property
    def running(self) -> int:
        """Sequences in the batch less those leaving it (their caller has gone; they are dropped,
        with their KV, at the next step boundary)."""
        return sum(not s.cancelled for s in self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: Request) -> Sequence:
        if self._closed:
            raise Unavailable("the dense worker is stopping")
        lim = self.limits
        running = self.running  # leaving sequences do not count: their callers are gone
        if running + len(self._waiting) >= lim.max_batch + lim.max_waiting:
            self.metrics.rejected.labels(reason="queue_full").inc()
            # a batch slot frees when a running sequence ends: roughly a few steps away
            retry = max(0.05, min(5.0, 4 * self._mean_step_s * (1 + len(self._waiting) / lim.max_batch)))
            raise ResourceExhausted(f"dense worker full: {running} running (max {lim.max_batch}), "
                                    f"{len(self._waiting)} waiting (max {lim.max_waiting})", retry_after_s=retry)
        seq = Sequence(request, lim.vocab_size, self._matcher(request))
        self._waiting.append(seq)
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self._wake.set()
        return seq

    def _matcher(self, request: Request) -> GrammarMatcher | None:
        if request.grammar is None:
            return None
        if self.grammars is None:
            raise InvalidArgument(f"request {request.request_id!r}: a grammar was given but this worker's model has "
                                  "no tokenizer.json to compile it against")
        return self.grammars.matcher(request.grammar)

    def release(self, seq: Sequence) -> None:
        """The caller is done with `seq` (finished, failed, or gone): a live one is cancelled. A
        waiting one leaves at once; a running one stops counting for admission at once and leaves
        the batch (its KV freed) at the next step boundary."""
        if seq.finished or seq.cancelled:
            return
        seq.cancelled = True
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._retire(seq, "cancelled")
        self._wake.set()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dense-worker-batcher")

    async def run_in_step_thread(self, fn: object) -> object:
        """Run a callable on the step thread (start-up work such as kernel warm-up)."""
        assert callable(fn)
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def stop(self) -> None:
        """Stop stepping; fail what is still queued or running with Unavailable."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self._thread.shutdown, wait=True)  # the step in flight, if any
        gone = Unavailable("the dense worker stopped")
        for seq in [*self._running, *self._waiting]:
            self._fail(seq, gone)
        self._waiting.clear()
        self._update_kv()

    # ---- the loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        """Step while sequences run. A step's outputs are handed to their callers (and its
        metrics observed) while the next step already runs: the batch of the next step is
        settled first (what finished or failed leaves it, cancelled and waiting sequences
        leave and join), then it starts, then the outputs go out. So the step thread does
        not wait for the event loop's share of every token (the outputs, their gRPC writes)."""
        loop = asyncio.get_running_loop()
        done: tuple[_Result, list[tuple[Sequence, SampledToken, str | None]]] | None = None  # settled, not emitted
        while True:
            self._reap()
            self._admit()
            self._update_kv()
            pending = self._start_step(loop) if self._running else None
            if done is not None:
                self._emit(*done)
                done = None
            if pending is None:
                if self.prefix is not None:
                    self.prefix.stepping(False)  # its disk writes may run now
                self._wake.clear()
                await self._wake.wait()
                continue
            result = await pending
            done = result, self._settle(result)
            if self._after_step is not None:
                self._after_step()  # between steps: it reads what the step thread counts

    def _start_step(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[_Result]:
        if self.prefix is not None:
            self.prefix.stepping(True)
        return loop.run_in_executor(self._thread, self._step, list(self._running))

    def _reap(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._running.remove(seq)
            self._retire(seq, "cancelled")

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.limits.max_batch:
            self._running.append(self._waiting.popleft())

    def _update_kv(self) -> None:
        self.kv_bytes = sum(s.cache.capacity_bytes for s in self._running if s.cache is not None)

    def _retire(self, seq: Sequence, reason: str) -> None:
        seq.finished = True
        seq.cache = None  # the KV goes with the last reference
        self.metrics.finished.labels(finish_reason=reason).inc()

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if not seq.finished:
            self._retire(seq, "failed")
            seq._put(error)

    @staticmethod
    def _failed_by(r: _Result) -> list[Sequence]:
        """The sequences a failed step fails: all of them, or where the expert provider named the
        rows it could not compute (experts with no live owner), only those rows' sequences; the
        others computed nothing this step (their KV was not committed) and are stepped again."""
        if not isinstance(r.error, RowsUnavailable):
            return [seq for seq, _ in r.rows]
        out, start = [], 0
        for seq, t in r.rows:
            if any(start <= row < start + len(t) for row in r.error.rows):
                out.append(seq)
            start += len(t)
        return out

    def _settle(self, r: _Result) -> list[tuple[Sequence, SampledToken, str | None]]:
        """A finished step's effect on the batch: the sequences it failed, and those that sampled
        their last token, leave. Returns the outputs to hand out (`_emit`): the tokens of the
        sequences still wanting them."""
        if r.error is not None:
            for seq in self._failed_by(r):
                self._fail(seq, r.error)
        outputs = []
        for seq, tok, reason in r.sampled:
            if seq.cancelled or seq.finished:
                continue
            outputs.append((seq, tok, reason))
            if reason is not None:
                self._running.remove(seq)
                self._retire(seq, reason)
        return outputs

    def _emit(self, r: _Result, outputs: list[tuple[Sequence, SampledToken, str | None]]) -> None:
        """Hand a settled step's outputs to their callers and observe its metrics (the loop's
        fields of a sequence only: the next step may be running)."""
        for query, hit in r.lookups:
            self.metrics.prefix_query.inc(query)
            self.metrics.prefix_hit.inc(hit)
        now = time.monotonic()
        for seq, tok, reason in outputs:
            if seq.cancelled:  # its caller left since the step ended
                continue
            req = seq.request
            first = seq.emitted == 0
            queue_s = (seq.first_step_at or now) - req.received
            seq._put(Output(tok, reason, r.timings, first, len(req.prompt) if first else 0,
                            seq.cached if first else 0, queue_s if first else 0.0))
            if first:
                self.metrics.ttft.observe(now - req.received)
                self.metrics.queue_time.observe(queue_s)
            else:
                self.metrics.itl.observe(now - seq.last_token_at)
            seq.emitted += 1
            seq.last_token_at = now
        t = r.timings
        self._mean_step_s = 0.9 * self._mean_step_s + 0.1 * t.step_s
        if r.error is None:
            phases = {"attention": t.attention_s, "gate": t.gate_s, "expert": t.expert_s, "sampling": t.sampling_s}
            phases["other"] = max(0.0, t.step_s - sum(phases.values()))
            predicted, actual, hits = r.prefetch
            self.metrics.observe_step(StepReport(rows=t.rows, sequences=len(r.rows), seconds=t.step_s, phases=phases,
                                                 generated=len(r.sampled), predicted=predicted, actual=actual,
                                                 hits=hits))
            decoding = r.decoding
            decode_tokens = sum(1 for seq, _, _ in r.sampled if id(seq) in decoding)
            d = r.decision
            self.metrics.observe_speculation(r.verified, len(decoding), decode_tokens, None if d is None else d.k,
                                             None if d is None else d.reason)

    # ---- the step (step thread) ----------------------------------------------------------
    def _lookup(self, seq: Sequence) -> tuple[int, int]:
        prompt = seq.request.prompt
        cache, n = None, 0
        if self.prefix is not None:
            try:
                cache, n = self.prefix.lookup(prompt)
            except Exception:
                log.exception("prefix cache lookup failed; prefilling the whole prompt")
                cache, n = None, 0
        seq.cache = cache if cache is not None else self.model.new_cache()
        # the most positions it may reach: its arrays grow towards that in fewer copies
        seq.cache.expect(min(len(prompt) + seq.request.params.max_tokens, self.limits.max_seq_len))
        # a fixed-size state is saved where the same prompt resumes (moetier/prefix_cache.py)
        seq.cache.save_at.add(len(prompt) - 1)
        seq.fed = seq.cached = n
        return len(prompt), n

    def _plan(self, batch: list[Sequence]) -> list[tuple[Sequence, I64]]:
        budget = self.limits.prefill_chunk
        rows: list[tuple[Sequence, I64]] = []
        for seq in batch:
            if seq.prefilling:
                if budget == 0:
                    continue
                n = min(len(seq.request.prompt) - seq.fed, budget)
                budget -= n
                rows.append((seq, seq.request.prompt[seq.fed : seq.fed + n]))
            else:
                assert seq.next_token is not None
                drafts = seq.draft.drafts if seq.draft is not None else []
                rows.append((seq, np.array([seq.next_token, *drafts], dtype=np.int64)))
        return rows

    def _step(self, batch: list[Sequence]) -> _Result:
        t0 = time.perf_counter()
        self.clock.reset()
        lookups = [self._lookup(s) for s in batch if s.cache is None]
        rows = self._plan(batch)
        now = time.monotonic()
        for seq, _ in rows:
            if seq.first_step_at is None:
                seq.first_step_at = now
        sampled: list[tuple[Sequence, SampledToken, str | None]] = []
        verified: list[tuple[int, int]] = []
        decision: Decision | None = None
        prefill: list[bool] = []
        error: BaseException | None = None
        mask_s = 0.0
        try:
            self.experts.new_step()
            work = []
            for seq, t in rows:
                assert seq.cache is not None  # set by _lookup
                work.append((seq.cache, t))
            starts = [c.length for c, _ in work]  # each sequence's first position this step
            prefill = [seq.prefilling for seq, _ in rows]  # prompt rows (else: a verify or decode step)
            misses0 = self._misses()
            f0 = time.perf_counter()
            hidden = self.model.forward(work)  # per sequence [n, D], final-normed
            logits = self._logits(rows, hidden)
            forward_s = time.perf_counter() - f0
            with self.clock.measure("sampling"):
                ready = []
                spec = []
                for (seq, t), lg, was_prompt in zip(rows, logits, prefill, strict=True):
                    if seq.prefilling:
                        seq.fed += len(t)
                        if seq.prefilling:
                            continue  # a prompt chunk short of the end: its logits choose nothing
                    if not was_prompt and len(t) > 1:  # x_N and the drafts made for it
                        spec.append((seq, lg))
                    else:
                        ready.append((seq, lg[-1]))
                m0 = time.perf_counter()
                masks = self._masks([s for s, _ in ready])
                mask_s = time.perf_counter() - m0
                for seq, lg in ready:
                    allowed = masks.get(id(seq))
                    tok = seq.sampler.choose(lg, allowed)
                    if seq.matcher is not None:
                        m0 = time.perf_counter()
                        seq.matcher.accept(tok.token)
                        mask_s += time.perf_counter() - m0
                    reason = seq.sampler.finish_reason(tok.token)
                    assert seq.cache is not None
                    if reason is None and seq.cache.length >= self.limits.max_seq_len:
                        reason = "length"
                    seq.next_token = tok.token
                    sampled.append((seq, tok, reason))
                for seq, lg in spec:
                    verified.append(self._verify(seq, lg, sampled))
            decision = (self._draft(rows, hidden, starts, prefill, sampled, forward_s, misses0)
                        if self.drafter else None)
            if self.prefix is not None:
                for seq, _, reason in sampled:
                    if reason is not None and seq.cache is not None:
                        try:
                            self.prefix.insert(seq.cache, handover=True)  # the sequence ends here
                        except Exception:
                            log.exception("prefix cache insert failed (the request is unaffected)")
        except Exception as e:  # handed to the sequences of this step
            if not isinstance(e, Unavailable | ResourceExhausted):
                log.exception("step failed")
            error, sampled = e, []
        pf = self.model.stats.prefetch
        seen, self._prefetch_seen = self._prefetch_seen, (pf.predicted, pf.actual, pf.hits)
        delta = (pf.predicted - seen[0], pf.actual - seen[1], pf.hits - seen[2])
        step_s = time.perf_counter() - t0
        c = self.clock.seconds
        timings = StepTimings(step_s, c["attention"], c["gate"], c["expert"], c["sampling"],
                              sum(len(t) for _, t in rows), mask_s)
        decoding = {id(seq) for (seq, _), p in zip(rows, prefill, strict=False) if not p}
        return _Result(rows, sampled, lookups, timings, error, delta, verified, decision, decoding)

    def _logits(self, rows: list[tuple[Sequence, I64]], hidden: list[np.ndarray]) -> list[np.ndarray]:
        """Per sequence the logits it needs [m, V], in one lm_head call: every row of a verify
        step, the last row of a prompt chunk that completes its prompt, none otherwise."""
        want = []
        for (seq, t), h in zip(rows, hidden, strict=True):
            if seq.prefilling:
                done = seq.fed + len(t) >= len(seq.request.prompt)
                want.append(h[-1:] if done else h[:0])
            else:
                want.append(h)
        flat = self.model.head(np.concatenate(want)) if any(len(w) for w in want) else None
        out, at = [], 0
        for w in want:
            out.append(flat[at : at + len(w)] if flat is not None else np.zeros((0, self.limits.vocab_size), np.float32))
            at += len(w)
        return out

    def _verify(self, seq: Sequence, logits: np.ndarray,
                sampled: list[tuple[Sequence, SampledToken, str | None]]) -> tuple[int, int]:
        """Verify one sequence's drafts (rows [x_N, d_1..d_k]): its tokens into `sampled`, its KV
        truncated to the accepted positions. Returns (drafted, accepted)."""
        assert seq.cache is not None and seq.draft is not None
        st = seq.draft
        fed = seq.cache.length - len(logits)  # N: the position of x_N
        emitted = [0]

        def finish(tok: SampledToken) -> str | None:
            emitted[0] += 1
            reason = seq.sampler.finish_reason(tok.token)
            if reason is None and fed + emitted[0] >= self.limits.max_seq_len:
                reason = "length"
            return reason

        v = verify(seq.sampler, logits, st.drafts, st.q, finish, seq.matcher)
        seq.cache.truncate(fed + v.accepted + 1)
        for tok, reason in zip(v.tokens, v.reasons, strict=True):
            sampled.append((seq, tok, reason))
        seq.next_token = v.tokens[-1].token
        return len(st.drafts), v.accepted

    def _misses(self) -> int:
        stats = getattr(self.experts, "stats", None)
        return int(getattr(stats, "store_misses", 0))

    def _draft(self, rows: list[tuple[Sequence, I64]], hidden: list[np.ndarray], starts: list[int],
               prefill: list[bool], sampled: list[tuple[Sequence, SampledToken, str | None]], forward_s: float,
               misses0: int) -> Decision:
        """The MTP head follows the step's sequences and drafts for the next step; the step's costs
        go to the controller. Returns its decision."""
        assert self.drafter is not None and self.controller is not None
        done = {id(seq) for seq, _, reason in sampled if reason is not None}
        new_tokens: dict[int, list[int]] = {}
        for seq, tok, _ in sampled:
            new_tokens.setdefault(id(seq), []).append(tok.token)
        generating = sum(1 for s, _ in rows if id(s) not in done and id(s) in new_tokens)
        prefill_rows = sum(len(t) for (s, t), p in zip(rows, prefill, strict=True) if p and s.prefilling)
        d = self.controller.decide(generating, prefill_rows)
        items, matchers = [], []
        for (seq, t), h, a, was_prompt in zip(rows, hidden, starts, prefill, strict=True):
            if seq.draft is None:
                seq.draft = self.drafter.new_state(seq.request.params.seed)
            feed = None
            if id(seq) not in done and d.feed:
                # MTP rows at positions a + 1 .. a + m: the token of each and the hidden state before it
                prompt = seq.request.prompt
                if was_prompt:  # every row valid; the token after the last is the prompt's or the sampled one
                    toks = [int(x) for x in prompt[a + 1 : a + len(t) + 1]]
                    toks += new_tokens.get(id(seq), [])[: len(t) - len(toks)]
                else:  # a verify (or decode) step: the positions up to the last accepted draft
                    toks = new_tokens[id(seq)]
                feed = Feed(np.asarray(toks, dtype=np.int64), h[: len(toks)], a + 1)
            k = 0
            if id(seq) in new_tokens and id(seq) not in done and may_draft(seq.request.params, self.controller):
                assert seq.cache is not None
                room = min(seq.request.params.max_tokens - seq.sampler.generated - 1,
                           self.limits.max_seq_len - seq.cache.length - 1)
                k = max(0, min(d.k, room))
            items.append((seq.draft, feed, seq.sampler, k))
            m = seq.matcher
            matchers.append(GrammarMatcher(m.raw.deep_copy(), m.vocab_size) if m is not None and k else None)
        m0 = time.perf_counter()
        self.drafter.advance(items, matchers)
        mtp_s = time.perf_counter() - m0 if any(f is not None for _, f, _, _ in items) else 0.0
        drafts = sum(len(t) - 1 for s, t in rows if not s.prefilling and len(t) > 1)
        expert_s = self.clock.seconds["expert"]
        pf = self.model.stats.prefetch
        self.controller.observe_step(StepCost(
            rows=sum(len(t) for _, t in rows), sequences=sum(1 for s, t in rows if len(t) > 1 and not s.prefilling),
            drafts=drafts, dense_s=max(forward_s - expert_s, 0.0), experts_s=expert_s, mtp_s=mtp_s,
            mtp_steps=max(d.k, 1) if mtp_s else 0, union=pf.actual - self._prefetch_seen[1],
            misses=self._misses() - misses0))
        return d

    def _masks(self, seqs: list[Sequence]) -> dict[int, np.ndarray]:
        """id(seq) -> [V] allowed tokens, for the sequences with a grammar (one parallel call)."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return {}
        masks = fill_masks([s.matcher for s in constrained if s.matcher is not None], self.limits.vocab_size)
        return {id(s): m for s, m in zip(constrained, masks, strict=True)}
