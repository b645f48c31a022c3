"""The dense worker's Prometheus metrics: this module owns every metric object.

Each worker has its own CollectorRegistry (several workers can live in one test process).
Gauges read the live state through callbacks; counters and histograms are fed by the
batcher after each step (`observe_step`) and by the request path. Labels are bounded:
phase, finish_reason, reason, outcome, tier.

| metric | type | labels | meaning |
|---|---|---|---|
| moetier_dense_worker_running_requests | gauge | | sequences in the running batch, less those whose caller has gone |
| moetier_dense_worker_waiting_requests | gauge | | requests admitted but not yet running |
| moetier_dense_worker_max_batch_requests | gauge | | batch size limit (inference.max_batch_size) |
| moetier_dense_worker_kv_cache_bytes | gauge | | bytes of KV cache held by live sequences (allocated) |
| moetier_dense_worker_steps_total | counter | | forward steps run |
| moetier_dense_worker_batch_rows | histogram | | rows per step (decode tokens + prefill chunk tokens) |
| moetier_dense_worker_batch_sequences | histogram | | sequences per step |
| moetier_dense_worker_step_seconds | histogram | | wall time of a step (forward pass + sampling) |
| moetier_dense_worker_step_phase_seconds | histogram | phase | a step's time by phase: attention, gate (routers, incl. predictions), expert (waiting on the expert store), sampling, other (embedding, norms, dense MLPs, shared experts, lm_head) |
| moetier_dense_worker_prompt_tokens_total | counter | | prompt tokens of admitted requests |
| moetier_dense_worker_generated_tokens_total | counter | | tokens generated |
| moetier_dense_worker_prefix_cache_query_tokens_total | counter | | prompt tokens looked up in the prefix cache |
| moetier_dense_worker_prefix_cache_hit_tokens_total | counter | | of those, served from the cache (not prefilled) |
| moetier_dense_worker_prefix_cache_bytes | gauge | tier | bytes of cached prefixes: memory, disk |
| moetier_dense_worker_prefix_cache_entries | gauge | | cached prefixes |
| moetier_dense_worker_prefix_cache_rejected_files_total | counter | | cache files ignored as torn, truncated or corrupt |
| moetier_dense_worker_time_to_first_token_seconds | histogram | | from receiving a request to its first token |
| moetier_dense_worker_inter_token_latency_seconds | histogram | | between consecutive tokens of a request |
| moetier_dense_worker_queue_time_seconds | histogram | | from receiving a request to its first step |
| moetier_dense_worker_finished_requests_total | counter | finish_reason | requests that ended: stop, length, cancelled (by the caller), failed (expert store or internal error) |
| moetier_dense_worker_rejected_requests_total | counter | reason | requests refused: queue_full (RESOURCE_EXHAUSTED), invalid (INVALID_ARGUMENT) |
| moetier_dense_worker_prefetch_predicted_experts_total | counter | | experts hinted before attention (per step and MoE layer) |
| moetier_dense_worker_prefetch_actual_experts_total | counter | | experts the layer then used (its batch union) |
| moetier_dense_worker_prefetch_hit_experts_total | counter | | hinted and used; recall = hit / actual, precision = hit / predicted |
| moetier_dense_worker_prefetch_hints_total | counter | outcome | Prefetch calls to the expert store: sent, failed |
| moetier_dense_worker_expert_calls_total | counter | outcome | ComputeExperts calls: ok, failed; shared: computed here from the store's shared experts instead |
| moetier_dense_worker_expert_call_seconds | histogram | | wall time of one ComputeExperts call (one MoE layer of one step) |
| moetier_dense_worker_store_expert_hits_total | counter | | experts of the calls' unions the store had in RAM |
| moetier_dense_worker_store_expert_misses_total | counter | | experts of the calls' unions the store read from disk |
| moetier_dense_worker_spec_drafted_tokens_total | counter | position | MTP drafts verified, by draft position 1..k (a draft is verified only when those before it were accepted) |
| moetier_dense_worker_spec_accepted_tokens_total | counter | position | of those, accepted; acceptance at position i = accepted / drafted |
| moetier_dense_worker_spec_forwards_total | counter | | decode forwards of a sequence (one per generating sequence per step, drafts or not) |
| moetier_dense_worker_spec_emitted_tokens_total | counter | | tokens those forwards produced; tokens per forward = emitted / forwards |
| moetier_dense_worker_spec_steps_total | counter | mode, reason | steps by what the controller chose for the next: mode on (drafting) or off, reason (off): disabled, no_mtp, cost, measuring, none |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.dense_worker.timing import PHASES

FINISH_REASONS = ("stop", "length", "cancelled", "failed")
REJECT_REASONS = ("queue_full", "invalid")
SPEC_OFF_REASONS = ("disabled", "no_mtp", "cost", "measuring")
SPEC_POSITIONS = 8  # drafts per step at most (inference.speculative_tokens <= 8)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class StepReport:
    """What one step did, for the metrics (plain numbers, made by the batcher)."""

    rows: int
    sequences: int
    seconds: float
    phases: dict[str, float]
    generated: int
    predicted: int  # prefetch accounting deltas of this step
    actual: int
    hits: int


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "moetier_dense_worker_"
        self.running = Gauge(p + "running_requests", "Sequences in the running batch, less those whose caller has gone.", registry=r)
        self.waiting = Gauge(p + "waiting_requests", "Requests admitted but not yet running.", registry=r)
        self.max_batch = Gauge(p + "max_batch_requests", "Batch size limit.", registry=r)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "KV cache bytes held by live sequences.", registry=r)
        self.steps = Counter(p + "steps", "Forward steps run.", registry=r)
        self.batch_rows = Histogram(p + "batch_rows", "Rows per step.", buckets=_ROW_BUCKETS, registry=r)
        self.batch_sequences = Histogram(p + "batch_sequences", "Sequences per step.", buckets=_SEQ_BUCKETS,
                                         registry=r)
        self.step_time = Histogram(p + "step_seconds", "Wall time of a step.", buckets=_STEP_BUCKETS, registry=r)
        self.phase_time = Histogram(p + "step_phase_seconds", "A step's time by phase.", ["phase"],
                                    buckets=_STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated.", registry=r)
        self.prefix_query = Counter(p + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
                                    registry=r)
        self.prefix_hit = Counter(p + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                  registry=r)
        self.prefix_bytes = Gauge(p + "prefix_cache_bytes", "Bytes of cached prefixes by tier.", ["tier"],
                                  registry=r)
        self.prefix_entries = Gauge(p + "prefix_cache_entries", "Cached prefixes.", registry=r)
        self.prefix_rejected = Counter(p + "prefix_cache_rejected_files", "Prefix cache files ignored as torn or "
                                       "corrupt.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From receiving a request to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Between consecutive tokens of a request.",
                             buckets=_STEP_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "queue_time_seconds", "From receiving a request to its first step.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter(p + "finished_requests", "Requests that ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(p + "rejected_requests", "Requests refused, by reason.", ["reason"], registry=r)
        self.predicted = Counter(p + "prefetch_predicted_experts", "Experts hinted before attention.", registry=r)
        self.actual = Counter(p + "prefetch_actual_experts", "Experts the MoE layers then used.", registry=r)
        self.hits = Counter(p + "prefetch_hit_experts", "Experts hinted and used.", registry=r)
        self.hints = Counter(p + "prefetch_hints", "Prefetch calls to the expert store.", ["outcome"], registry=r)
        self.expert_calls = Counter(p + "expert_calls", "ComputeExperts calls.", ["outcome"], registry=r)
        self.expert_call_time = Histogram(p + "expert_call_seconds", "Wall time of one ComputeExperts call.",
                                          buckets=_STEP_BUCKETS, registry=r)
        self.store_hits = Counter(p + "store_expert_hits", "Experts of the calls' unions in the store's RAM.",
                                  registry=r)
        self.store_misses = Counter(p + "store_expert_misses", "Experts of the calls' unions read from disk.",
                                    registry=r)
        self.spec_drafted = Counter(p + "spec_drafted_tokens", "MTP drafts verified, by draft position.",
                                    ["position"], registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "MTP drafts accepted, by draft position.",
                                     ["position"], registry=r)
        self.spec_forwards = Counter(p + "spec_forwards", "Decode forwards of a sequence.", registry=r)
        self.spec_emitted = Counter(p + "spec_emitted_tokens", "Tokens the decode forwards produced.", registry=r)
        self.spec_steps = Counter(p + "spec_steps", "Steps by the controller's choice for the next.",
                                  ["mode", "reason"], registry=r)
        # Every label value exists from the start, so rates and dashboards see zeros, not gaps.
        for i in range(1, SPEC_POSITIONS + 1):
            self.spec_drafted.labels(position=str(i))
            self.spec_accepted.labels(position=str(i))
        self.spec_steps.labels(mode="on", reason="none")
        for reason in SPEC_OFF_REASONS:
            self.spec_steps.labels(mode="off", reason=reason)
        for phase in PHASES:
            self.phase_time.labels(phase=phase)
        for reason in FINISH_REASONS:
            self.finished.labels(finish_reason=reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        for outcome in ("sent", "failed"):
            self.hints.labels(outcome=outcome)
        for outcome in ("ok", "failed"):
            self.expert_calls.labels(outcome=outcome)
        for tier in ("memory", "disk"):
            self.prefix_bytes.labels(tier=tier)

    def observe_state(self, running: Callable[[], int], waiting: Callable[[], int], kv_bytes: Callable[[], int],
                      max_batch: int) -> None:
        """Point the gauges at the live state."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_bytes.set_function(kv_bytes)
        self.max_batch.set(max_batch)

    def observe_speculation(self, verified: list[tuple[int, int]], forwards: int, emitted: int,
                            k: int | None, reason: str | None) -> None:
        """One step: (drafted, accepted) of each verifying sequence, its decode forwards and the
        tokens they emitted, and the controller's choice for the next step (k None: no decision)."""
        for drafted, accepted in verified:
            for i in range(1, min(drafted, accepted + 1, SPEC_POSITIONS) + 1):
                self.spec_drafted.labels(position=str(i)).inc()
                if i <= accepted:
                    self.spec_accepted.labels(position=str(i)).inc()
        self.spec_forwards.inc(forwards)
        self.spec_emitted.inc(emitted)
        if k is not None:
            if k > 0:
                self.spec_steps.labels(mode="on", reason="none").inc()
            elif reason in SPEC_OFF_REASONS:
                self.spec_steps.labels(mode="off", reason=reason).inc()

    def observe_step(self, s: StepReport) -> None:
        self.steps.inc()
        self.batch_rows.observe(s.rows)
        self.batch_sequences.observe(s.sequences)
        self.step_time.observe(s.seconds)
        for phase, seconds in s.phases.items():
            self.phase_time.labels(phase=phase).observe(seconds)
        self.generated_tokens.inc(s.generated)
        self.predicted.inc(s.predicted)
        self.actual.inc(s.actual)
        self.hits.inc(s.hits)
