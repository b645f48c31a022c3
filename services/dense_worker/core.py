"""The dense worker's domain: the model's dense part, the batcher, the prefix cache and the
expert store client, wired together. No protobuf here (convert.py), no gRPC server
(server.py).

    core = WorkerCore(settings)            # container opened, dense tensors resident
    await core.start()                     # kernels warmed, batcher running
    seq = core.submit(request)             # -> batcher.Sequence (outputs(), release())
    core.load()                            # running, waiting, KV bytes, prefix hashes
    await core.stop()                      # in-flight requests failed, cache files flushed

The Model is the in-process engine's (same dense tensors, same FastOps kernels); only the
expert provider differs: `RemoteExperts`, one ComputeExperts call per MoE layer per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from moetier.engine import load_dense, load_mtp
from moetier.errors import InvalidArgument, Unavailable
from moetier.kernels.fast import FastOps, warmup
from moetier.model.forward import Model
from moetier.model.speculative import Drafter
from moetier.prefix import BLOCK
from moetier.prefix_cache import PrefixCache, kv_identity
from moetier.profile import profile_threads
from moetier.settings import Settings, parse_bytes
from moetier.speculation import Controller
from moetier.text.grammar import GrammarCompiler
from moetier.text.tokenizer import TextTokenizer
from moetier.weights.container import Container
from services.dense_worker.batcher import Batcher, Limits, Request, Sequence
from services.dense_worker.metrics import WorkerMetrics
from services.dense_worker.remote import RemoteExperts, SharedCompute
from services.dense_worker.sharded import ShardedExperts
from services.dense_worker.timing import PhaseClock, instrument

log = logging.getLogger(__name__)

PREFIX_HASHES_REPORTED = 8192  # most recently used first; bounds a heartbeat's size


@dataclass(frozen=True)
class LoadSnapshot:
    running: int
    waiting: int
    kv_bytes: int
    max_batch: int
    max_waiting: int
    prefix_hashes: list[int]
    prefix_block: int


def prefix_dir(settings: Settings, model_id: str) -> Path:
    return (settings.inference.prefix_cache_dir or settings.data_path / "prefix-cache" / model_id).expanduser()


def _grammars(model_dir: Path, vocab_size: int) -> GrammarCompiler | None:
    """Structured outputs' compiler for the container's tokenizer (None without tokenizer.json)."""
    if not (model_dir / "tokenizer.json").is_file():
        log.info("%s has no tokenizer.json: requests with a grammar are refused", model_dir)
        return None
    return GrammarCompiler.from_dir(model_dir, vocab_size, TextTokenizer.from_dir(model_dir).eos_token_ids)


class WorkerCore:
    def __init__(self, settings: Settings, *, threads: int | None = None) -> None:
        """threads: kernel threads of the step (default: the profile `moetier tune` saved, else every
        CPU, as the in-process engine)."""
        if settings.model.path is None:
            raise InvalidArgument("the dense worker needs a model directory (--model or model.path)")
        self.settings = settings
        self.worker_id = settings.dense_worker.id
        inf = settings.inference
        self.container = Container.open(settings.model.path, partial_experts=True)  # reads no expert file
        try:
            args = self.container.args
            self.model_id = self.container.index.identity
            self.clock = PhaseClock()
            self.ops = FastOps(threads=threads if threads is not None else profile_threads(settings))
            parse = self.container.index.parse
            # a store on this host that shares its experts: its calls computed here, on these kernels
            shared = SharedCompute(self.ops, parse) if inf.shared_experts and parse is not None else None
            self.experts: RemoteExperts | ShardedExperts
            if inf.expert_placement == "router":  # experts sharded over the stores of the router's map
                self.experts = ShardedExperts(settings.router.address, self.model_id, timeout_s=inf.expert_timeout_s,
                                              clock=self.clock, hidden_size=args.hidden_size,
                                              local_lane=inf.local_lane, refresh_s=settings.heartbeat_interval_s,
                                              shared=shared)
            else:
                self.experts = RemoteExperts(settings.expert_store.address, self.model_id,
                                             timeout_s=inf.expert_timeout_s, clock=self.clock,
                                             hidden_size=args.hidden_size, local_lane=inf.local_lane, shared=shared)
            self.model = Model(args, load_dense(self.container), self.ops, self.experts)
            instrument(self.model, self.clock)
            # speculative decoding: the MTP head's dense part resident, its experts memory-mapped here
            mtp = load_mtp(self.container, self.model, self.ops) if inf.speculative_tokens else None
            self.mtp_experts = mtp[1] if mtp is not None else None
            self.controller = Controller(inf.speculative_tokens, moe_layers=len(args.moe_layer_ids),
                                         experts=args.n_routed_experts, top_k=args.num_experts_per_tok,
                                         has_mtp=mtp is not None)
            self.prefix = PrefixCache(args, self.model_id,
                                      kv_identity(self.container.files, self.model_id, args),
                                      prefix_dir(settings, self.model_id), parse_bytes(inf.prefix_cache_bytes),
                                      memory_bytes=parse_bytes(inf.prefix_cache_memory_bytes))
        except BaseException:
            self.container.close()
            raise
        self.limits = Limits(max_batch=inf.max_batch_size, max_waiting=inf.max_waiting,
                             max_seq_len=min(inf.max_seq_len, args.max_position_embeddings),
                             prefill_chunk=inf.prefill_chunk, vocab_size=args.vocab_size)
        self.metrics = WorkerMetrics()
        self._prefix_seen = self.prefix.stats()
        self._remote_seen: dict[str, int] = {}
        self.metrics.prefix_rejected.inc(self._prefix_seen.files_rejected)
        self.batcher = Batcher(self.model, self.experts, self.prefix, self.clock, self.metrics, self.limits,
                               after_step=self.refresh_metrics, grammars=_grammars(settings.model.path, args.vocab_size),
                               drafter=Drafter(mtp[0]) if mtp is not None else None, controller=self.controller)
        log.info("dense worker %s: %s (%s, %d layers), model %s, expert store %s, %s, batch %d + %d waiting, "
                 "prefix cache %s, speculative decoding %s", self.worker_id, settings.model.path, args.arch,
                 args.num_layers, self.model_id, settings.expert_store.address
                 if inf.expert_placement == "store" else f"placement map of router {settings.router.address}", self.ops, self.limits.max_batch,
                 self.limits.max_waiting, self.prefix.directory,
                 f"up to {inf.speculative_tokens} drafts per step (MTP head, {mtp[0].depth} layer(s))"
                 if mtp is not None else "off" if not inf.speculative_tokens else "off (the model has no MTP head)")

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Warm the kernels on the step thread, reach the store (not required), start batching."""
        await self.batcher.run_in_step_thread(warmup)
        try:
            await self.batcher.run_in_step_thread(self.experts.check)
        except Unavailable as e:
            log.warning("%s; requests fail with UNAVAILABLE until it answers", e)
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        self.prefix.close()
        if self.mtp_experts is not None:
            self.mtp_experts.close()
        self.experts.close()
        self.container.close()

    # ---- requests -------------------------------------------------------------------
    def submit(self, request: Request) -> Sequence:
        return self.batcher.submit(request)

    def release(self, seq: Sequence) -> None:
        self.batcher.release(seq)

    def note_invalid(self) -> None:
        self.metrics.rejected.labels(reason="invalid").inc()

    def load(self) -> LoadSnapshot:
        self._update_prefix_metrics()
        return LoadSnapshot(running=self.batcher.running, waiting=self.batcher.waiting,
                            kv_bytes=self.batcher.kv_bytes, max_batch=self.limits.max_batch,
                            max_waiting=self.limits.max_waiting,
                            prefix_hashes=self.prefix.hashes(PREFIX_HASHES_REPORTED), prefix_block=BLOCK)

    def _update_prefix_metrics(self) -> None:
        s = self.prefix.stats()
        m = self.metrics
        m.prefix_bytes.labels(tier="memory").set(s.memory_bytes)
        m.prefix_bytes.labels(tier="disk").set(s.disk_bytes)
        m.prefix_entries.set(s.entries)
        m.prefix_rejected.inc(s.files_rejected - self._prefix_seen.files_rejected)
        self._prefix_seen = s

    def refresh_metrics(self) -> None:
        """Bring the metrics that are counted elsewhere (prefix cache, expert store client) up to date."""
        self._update_prefix_metrics()
        self.experts.flush_usage(force=self.batcher.running == 0)  # idle: the store's heat is up to date now
        r = self.experts.stats
        m = self.metrics
        for name, counter, value in (("ok", m.expert_calls.labels(outcome="ok"), r.calls),
                                     ("failed", m.expert_calls.labels(outcome="failed"), r.failed_calls),
                                     ("shared", m.expert_calls.labels(outcome="shared"), r.shared_calls),
                                     ("sent", m.hints.labels(outcome="sent"), r.hints_sent),
                                     ("hfailed", m.hints.labels(outcome="failed"), r.hints_failed),
                                     ("hits", m.store_hits, r.store_hits), ("misses", m.store_misses, r.store_misses)):
            before = self._remote_seen.get(name, 0)
            if value > before:
                counter.inc(value - before)
            self._remote_seen[name] = value
        calls = self.experts.call_seconds
        while calls:
            m.expert_call_time.observe(calls.popleft())
