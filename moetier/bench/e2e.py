"""`moetier bench e2e`: decode through the cluster beside the in-process engine, each beside its bounds.

The model is the benchmark model (mini-glm; `--model DIR` for another) with an expert RAM tier
of `--budget` (default 25%) of its expert bytes. Two systems serve it, alternately (ABBA order
over `--rounds`, so disk drift hits both):

  * engine: the in-process reference (`moetier.engine.Engine`: resident dense part, FastOps,
    `TieredExperts`), its tier configured exactly as the expert store configures its own
    (`tier_config`: budget, policy, prefetch bound; the store's queue depth and O_DIRECT);
  * cluster: router -> dense worker -> expert store, real gRPC servers on loopback port 0,
    each in a process of its own as `moetier up` runs them (its own interpreter, GIL, event
    loop and kernel thread pool; `--in-process` puts all three in this process instead, one
    GIL among them, which costs the cluster time a deployment does not pay), the request sent
    to the router's Generate as the gateway sends it. The worker's prefix cache is off, so the
    second request is prefilled like the first. The store computes with as many kernel
    threads as the engine (`--store-threads`; its own default is CPUs - 1), so the two differ
    by the hops, not by their kernels' threads. The services' counters are read through a
    pipe to each process (a thread there answers; it is asked only between requests and at
    a request's first token).

Each trial starts its system fresh (page cache dropped where root, tier empty) and runs two
requests of the same `--prompt-tokens` tokens of shipped text, each generating `--tokens`
greedy tokens at batch 1: the first is cold, the second warm (the tier as the first left it).
Per request: TTFT (request sent -> first token), decode tok/s (first -> last token), and per
decode step the time beside its bounds, counted from the tier's and the model's own stats:

  * missed expert bytes = experts of the layers' unions that had to come from disk (demand
    reads + prefetch reads that were then used) x record bytes; disk bound = that / fio GB/s,
    fio measured right before the trial on the model's expert files (randread, O_DIRECT, block
    size = record size, iodepth = the store's queue depth);
  * touched bytes = experts of the layers' unions (hits + misses) x record bytes + the dense
    bytes a decode step reads (every resident dense tensor but the embedding table, plus one
    embedding row); memory bound = that / memory GB/s (a numpy copy, as `bench compute`);
  * bound = max(disk, memory): reads and compute overlap (DESIGN.md, performance model).

Also the prefetch recall (hinted experts the layer then used / experts it used) and, for the
cluster, where the hops cost: the worker's step time, its wait on ComputeExperts calls, the
store's own load + kernel time of those calls (the difference is the RPC hop), and the
client's time per token beyond the worker's step (the router and stream hop).

`hop_overhead` (also `ratio`): decode time per token through the cluster / through the engine,
both requests pooled, median over rounds (each round's two trials adjacent in time). Target
<= 1.15. The cluster's tokens must equal the engine's (temperature 0); `tokens_match` says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from moetier.bench import models
from moetier.bench.compute import copy_gbps
from moetier.bench.io import _drop_page_cache, _fio_pass, find_fio
from moetier.errors import InvalidArgument, Unavailable
from moetier.kernels.fast import default_threads
from moetier.model.ops import start_moe
from moetier.settings import Settings, apply_kernel_settings, load_settings
from moetier.store.stats import TierStats
from moetier.store.tier import TierConfig

log = logging.getLogger(__name__)

TARGET = 1.15
QUIESCE_S = 2.0  # wait this long at most for prefetch reads in flight before the final count
QUIET_LOGGERS = ("services", "moetier.cluster", "moetier.store", "moetier.engine")
CHILD_START_S = 300.0  # a service process's start (imports, dense tensors, kernel warm-up) at most
CHILD_REPLY_S = 60.0  # a service process's answer to a counters request at most


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "e2e", help="decode tok/s through router + worker + store beside the in-process engine and the "
                    "disk / memory bounds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    models.add_model_args(p)
    p.add_argument("--budget", default="25%", help="expert RAM tier: share of the expert bytes or bytes "
                   "(default 25%%)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="engine/cluster pairs, alternating order (default 3: "
                   "on a shared machine single rounds ranged 0.9-1.7)")
    p.add_argument("--policy", choices=["lru", "lfu", "learned"],
                   help="replacement policy of both tiers (default: settings cache.policy)")
    p.add_argument("--threads", type=int, help="kernel threads of the engine and the dense worker "
                   "(default: every CPU)")
    p.add_argument("--store-threads", type=int, help="kernel threads of the expert store (default: the same as "
                   "the engine's, so the two compute alike; the store's own default is CPUs - 1)")
    p.add_argument("--fio-records", type=int, default=64, help="records fio reads per trial (default 64)")
    p.add_argument("--copy-mb", type=int, default=512, help="size of the memory bandwidth copy (default 512 MiB)")
    p.add_argument("--in-process", action="store_true", help="run router, dense worker and expert store in this "
                   "process (one GIL, one event loop) instead of a process each, as `moetier up` runs them")
    p.set_defaults(func=run)


# ---- counters ------------------------------------------------------------------------------
@dataclass
class Counts:
    """Monotonic counters at one moment (tier, I/O, the model's prefetch prediction, store calls)."""

    t: float
    hits: int = 0
    misses: int = 0
    submitted: int = 0  # distinct reads submitted (demand + prefetch)
    cancelled: int = 0  # queued prefetch reads dropped before they started
    read_bytes: int = 0
    pf_issued: int = 0
    pf_useful: int = 0
    predicted: int = 0  # the model's prefetch prediction: experts hinted
    actual: int = 0  # experts the layers then used
    pf_hits: int = 0  # hinted and used
    read_wait_s: float = 0.0  # the tier's wait for demanded experts' reads (calls with misses)
    store_load_s: float = 0.0  # cluster: the store's time making the calls' unions resident
    store_compute_s: float = 0.0  # cluster: the store's kernel time
    expert_s: float = 0.0  # the model's wait on its expert provider's `moe` (tier + kernels, or the RPC)
    call_s: float = 0.0  # the provider's calls from start to answer (cluster: the ComputeExperts round
    # trips, which the shared expert overlaps; engine: the same as expert_s)
    hint_s: float = 0.0  # the model's time in its provider's `prefetch` (issuing the hints)

    def __sub__(self, o: Counts) -> Counts:
        return Counts(**{k: getattr(self, k) - getattr(o, k) for k in self.__dataclass_fields__})


class TimedExperts:
    """A pass-through expert provider that clocks the model's calls into its provider: `moe`
    (engine: the tier's load + the kernels; cluster: the ComputeExperts round trip) and
    `prefetch` (issuing a hint). The same wrapper on both systems, so their times compare."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.moe_s = 0.0
        self.prefetch_s = 0.0

    def moe(self, layer: int, x: Any, ids: Any, weights: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.inner.moe(layer, x, ids, weights)
        finally:
            self.moe_s += time.perf_counter() - t

    def moe_start(self, layer: int, x: Any, ids: Any, weights: Any) -> Any:
        """The model's wait: starting the call, then waiting for its result (the shared expert
        computes in between, counted in neither)."""
        t = time.perf_counter()
        try:
            return _TimedCall(self, start_moe(self.inner, layer, x, ids, weights))
        finally:
            self.moe_s += time.perf_counter() - t

    def prefetch(self, layer: int, ids: Any) -> None:
        t = time.perf_counter()
        try:
            self.inner.prefetch(layer, ids)
        finally:
            self.prefetch_s += time.perf_counter() - t


class _TimedCall:
    def __init__(self, clock: TimedExperts, call: Any) -> None:
        self.clock, self.call = clock, call

    def result(self) -> Any:
        t = time.perf_counter()
        try:
            return self.call.result()
        finally:
            self.clock.moe_s += time.perf_counter() - t

    def abandon(self) -> None:
        self.call.abandon()


def tier_counts(tier: TierStats) -> dict[str, Any]:
    """The tier's part of `Counts` (the engine's tier, or the store's)."""
    io = tier.io
    return {"hits": sum(tier.hits.values()), "misses": sum(tier.misses.values()),
            "submitted": io.submitted if io else 0, "cancelled": io.cancelled if io else 0,
            "read_bytes": io.bytes if io else 0, "pf_issued": tier.prefetch_issued,
            "pf_useful": tier.prefetch_useful, "read_wait_s": tier.miss_wait.sum}


def store_counts(core: Any) -> dict[str, Any]:
    """The expert store's part of `Counts`: its tier, and its own load and kernel time."""
    reg = core.metrics.registry
    return {**tier_counts(core.tier_stats()),
            "store_load_s": reg.get_sample_value("moetier_expert_store_load_seconds_sum") or 0.0,
            "store_compute_s": reg.get_sample_value("moetier_expert_store_compute_seconds_sum") or 0.0}


def model_counts(model: Any) -> dict[str, Any]:
    """The model's part of `Counts`: its prefetch prediction, and its `TimedExperts` clock."""
    pf = model.stats.prefetch
    clock = model.experts
    # RemoteExperts: its round trips; in-process: the wait itself
    call_s = float(getattr(getattr(clock.inner, "stats", None), "call_s", clock.moe_s))
    return {"predicted": pf.predicted, "actual": pf.actual, "pf_hits": pf.hits, "expert_s": clock.moe_s,
            "call_s": call_s, "hint_s": clock.prefetch_s}


def counts(t: float, *parts: dict[str, Any]) -> Counts:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return Counts(t, **merged)


@dataclass
class Phase:
    """A request's decode steps (batch 1: one token each), from the counters' differences."""

    steps: int
    seconds: float
    hit_rate: float
    missed_bytes: float  # per step: experts that had to come from disk x record bytes
    read_bytes: float  # per step: bytes the I/O engine read (wasted prefetch reads included)
    touched_bytes: float  # per step: union experts x record bytes + dense bytes
    disk_bound_s: float
    memory_bound_s: float
    recall: float  # prefetch recall of the step's MoE layers
    expert_s: float  # per step: the model's wait on `moe` calls
    hint_s: float  # per step: the model's time issuing prefetch hints
    store_s: float  # cluster, per step: the store's load + kernel time (0 for the engine)
    read_wait_s: float  # per step: the tier's wait for demanded reads (within expert_s, or store_s)
    store_load_s: float  # cluster, per step: the store's load time alone (hits, reads, waits)
    call_s: float  # per step: the provider's calls from start to answer

    @property
    def s_per_token(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def bound_s(self) -> float:
        return max(self.disk_bound_s, self.memory_bound_s)


def phase(d: Counts, steps: int, record: int, dense_step: int, fio_gbps: float, mem_gbps: float) -> Phase:
    steps = max(1, steps)
    demanded = d.hits + d.misses
    missed = (d.submitted - d.pf_issued) + d.pf_useful  # demand reads + prefetch reads then used
    missed_b = missed * record / steps
    touched_b = demanded * record / steps + dense_step
    return Phase(steps, d.t, d.hits / demanded if demanded else 0.0, missed_b, d.read_bytes / steps, touched_b,
                 missed_b / (fio_gbps * 1e9), touched_b / (mem_gbps * 1e9),
                 d.pf_hits / d.actual if d.actual else 0.0, d.expert_s / steps, d.hint_s / steps,
                 (d.store_load_s + d.store_compute_s) / steps, d.read_wait_s / steps, d.store_load_s / steps,
                 d.call_s / steps)


@dataclass
class Request:
    tokens: list[int]
    ttft_s: float
    decode: Phase
    prefill_missed_bytes: float  # the prompt step(s): experts read from disk x record bytes
    worker_step_s: float = 0.0  # cluster, per decode token: the worker's step (its own clock)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.decode.s_per_token if self.decode.s_per_token else 0.0


@dataclass
class Trial:
    kind: str  # engine | cluster
    fio_gbps: float
    memory_gbps: float
    start_s: float
    requests: list[Request] = field(default_factory=list)

    @property
    def s_per_token(self) -> float:
        """Decode time per token, both requests pooled."""
        return sum(r.decode.seconds for r in self.requests) / sum(r.decode.steps for r in self.requests)


# ---- the run --------------------------------------------------------------------------------
@dataclass
class Setup:
    model: Path
    settings: Settings  # the cluster's settings, less the per-trial addresses and data_dir
    config: TierConfig
    prompt: list[int]
    tokens: int
    threads: int  # kernel threads of the engine and of the dense worker
    store_threads: int  # kernel threads of the expert store
    record_bytes: int
    dense_step_bytes: int
    expert_files: list[Path]
    fio: str
    fio_records: int
    copy: tuple[np.ndarray, np.ndarray]
    processes: bool  # the cluster's services each in a process of their own


def run(args: argparse.Namespace) -> int:
    fio = find_fio("e2e", "the disk bound is measured with it")
    if fio is None:
        return 2
    if args.tokens < 2 or args.prompt_tokens < 1 or args.rounds < 1 or args.fio_records < 1:
        raise InvalidArgument("--tokens must be >= 2; --prompt-tokens, --rounds and --fio-records >= 1")
    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # -v keeps the services' start/stop lines
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    setup = prepare(args, fio)
    root = os.geteuid() == 0
    rounds = []
    for r in range(args.rounds):
        order = ("engine", "cluster") if r % 2 == 0 else ("cluster", "engine")
        row: dict[str, Trial] = {}
        for kind in order:
            row[kind] = trial(setup, kind, root)
            print(f"round {r + 1} {kind}: {row[kind].s_per_token:.3f} s/token", file=sys.stderr, flush=True)
        rounds.append({"order": list(order), **row})
    out = summarize(setup, args, rounds, root)
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return 0


def prepare(args: argparse.Namespace, fio: str) -> Setup:
    from moetier.text.tokenizer import TextTokenizer
    from moetier.weights.container import Container
    from services.expert_store.core import tier_config

    model = models.resolve_model(args)
    overrides: dict[str, Any] = {"model": {"path": str(model), "expert_cache": args.budget},
                                 "inference": {"prefix_cache_bytes": "0"}}
    if args.policy:
        overrides["cache"] = {"policy": args.policy}
    settings = load_settings(args.config, overrides=overrides)
    apply_kernel_settings(settings)
    with Container.open(model) as c:
        config = tier_config(settings, c.expert_bytes)
        config.history_path = None  # both systems start without usage history
        record = c.layout.record_bytes
        dense = 0
        for name in c.dense_names():
            t = c.dense(name)
            n = t.data.nbytes + (t.scales.nbytes if t.scales is not None else 0)
            dense += n // t.shape[0] if name == "embed" else n  # a step reads one embedding row per token
        files = [c.path / "experts" / f for f in c.index.files]
        prompt = models.prompt_ids(TextTokenizer.from_dir(model), args.prompt_tokens)
        if len(prompt) + args.tokens > c.args.max_position_embeddings:
            raise InvalidArgument(f"--prompt-tokens + --tokens exceed the model's {c.args.max_position_embeddings}")
    src = np.ones(max(1, args.copy_mb) << 18, dtype=np.float32)  # copy_mb MiB
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    threads = args.threads if args.threads is not None else default_threads()
    store_threads = args.store_threads if args.store_threads is not None else threads
    return Setup(model, settings, config, prompt, args.tokens, threads, store_threads, record, dense,
                 files, fio, args.fio_records, (src, dst), not args.in_process)


def trial(s: Setup, kind: str, root: bool) -> Trial:
    """Bandwidths measured now, then a fresh system (page cache dropped where root), two requests."""
    qd = s.settings.storage.queue_depth
    nbytes, secs = _fio_pass(s.fio, s.expert_files, s.record_bytes, qd, s.fio_records, "libaio")
    mem = max(copy_gbps(*s.copy) for _ in range(3))
    t = Trial(kind, nbytes / secs / 1e9, mem, 0.0)
    if root:
        _drop_page_cache()
    if kind == "engine":
        _engine_trial(s, t)
    else:
        asyncio.run(_cluster_trial(s, t))
    return t


def _quiesce(stats: Any) -> None:
    deadline = time.monotonic() + QUIESCE_S
    while stats().loading_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


def _engine_trial(s: Setup, t: Trial) -> None:
    from moetier.engine import Engine, load_dense, make_ops
    from moetier.kernels.fast import warmup
    from moetier.model.forward import Model
    from moetier.model.sampling import SamplingParams
    from moetier.store.provider import TieredExperts
    from moetier.weights.container import Container

    t0 = time.perf_counter()
    container = Container.open(s.model)
    st = s.settings.storage
    try:
        ops = make_ops(False, s.threads)
        experts = TieredExperts.open(container, ops, s.config, depth=st.queue_depth, direct=st.direct_io)
        model = Model(container.args, load_dense(container), ops, TimedExperts(experts))
        engine = Engine(container, model, experts)
    except BaseException:
        container.close()
        raise
    with engine:
        warmup()
        t.start_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=s.tokens, ignore_eos=True)
        tier = engine.experts.tier
        def now() -> Counts:
            return counts(time.perf_counter(), tier_counts(tier.stats()), model_counts(engine.model))

        for _ in range(2):
            before = now()
            first: Counts | None = None
            toks: list[int] = []
            for g in engine.generate(s.prompt, params, chunk_size=s.settings.inference.prefill_chunk):
                toks.append(g.token)
                if first is None:
                    first = now()
            end = now()  # decode ends with the last token (reads still in
            # flight are counted in neither request)
            _quiesce(tier.stats)
            assert first is not None
            t.requests.append(_request(s, t, toks, before, first, end))


def _request(s: Setup, t: Trial, toks: list[int], before: Counts, first: Counts, end: Counts,
             worker_step_s: float = 0.0) -> Request:
    pre = first - before
    steps = len(toks) - 1
    pre_missed = ((pre.submitted - pre.pf_issued) + pre.pf_useful) * s.record_bytes
    return Request(toks, pre.t, phase(end - first, steps, s.record_bytes, s.dense_step_bytes, t.fio_gbps,
                                      t.memory_gbps), pre_missed, worker_step_s / steps)


async def _cluster_trial(s: Setup, t: Trial) -> None:
    import grpc

    from moetier.rpc.v1 import generate_pb2, router_pb2_grpc

    t0 = time.perf_counter()
    data = Path(tempfile.mkdtemp(prefix="moetier-bench-e2e-"))
    try:
        async with (_process_cluster(s, data) if s.processes else _in_process_cluster(s, data)) as cluster:
            t.start_s = time.perf_counter() - t0
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for i in range(2):
                    req = generate_pb2.GenerateRequest(
                        request_id=f"bench-e2e-{i}", prompt_ids=s.prompt,
                        sampling=generate_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=s.tokens))
                    before = cluster.counts()
                    first: Counts | None = None
                    toks: list[int] = []
                    step_ns = 0
                    async for m in stub.Generate(req, timeout=3600):
                        toks.extend(tok.token_id for tok in m.tokens)
                        if first is None:
                            first = cluster.counts()
                        else:  # decode steps: the worker's own clock
                            step_ns += m.timings.step_ns
                    end = cluster.counts()
                    await asyncio.to_thread(cluster.quiesce)
                    assert first is not None
                    t.requests.append(_request(s, t, toks, before, first, end, step_ns / 1e9))
    finally:
        shutil.rmtree(data, ignore_errors=True)


class _InProcess:
    """The cluster's services as objects in this process: counters read directly."""

    def __init__(self, router_port: int, store: Any, worker: Any) -> None:
        self.router_port = router_port
        self.store, self.model = store.core, worker.core.model
        self.model.experts = TimedExperts(self.model.experts)  # the worker's RemoteExperts, clocked as the engine's tier

    def counts(self) -> Counts:
        return counts(time.perf_counter(), store_counts(self.store), model_counts(self.model))

    def quiesce(self) -> None:
        _quiesce(self.store.tier_stats)


@contextlib.asynccontextmanager
async def _in_process_cluster(s: Setup, data: Path) -> AsyncIterator[_InProcess]:
    from services.dense_worker.server import create_server as create_worker
    from services.expert_store.server import create_server as create_store
    from services.router.server import create_server as create_router

    started: list[Any] = []
    try:
        router, rport = create_router(_cluster_settings(s, data, 0, 0), "127.0.0.1:0")
        await router.start()
        started.append(router)
        store, sport = create_store(_cluster_settings(s, data, rport, 0), "127.0.0.1:0", threads=s.store_threads)
        await store.start()
        started.append(store)
        worker, _ = create_worker(_cluster_settings(s, data, rport, sport), "127.0.0.1:0", register=True,
                                  threads=s.threads)
        await worker.start()
        started.append(worker)
        await _registered(worker)
        yield _InProcess(rport, store, worker)
    finally:
        for server in reversed(started):
            await server.stop(0)


async def _registered(worker: Any) -> None:
    deadline = time.monotonic() + 30
    while not (worker.agent and worker.agent.registered.is_set()):
        if time.monotonic() > deadline:
            raise InvalidArgument("the dense worker did not register with the router within 30 s")
        await asyncio.sleep(0.01)


class _Processes:
    """The cluster's services each in a process of its own: counters asked for through pipes."""

    def __init__(self, router_port: int, store: _ServiceProcess, worker: _ServiceProcess) -> None:
        self.router_port, self.store, self.worker = router_port, store, worker

    def counts(self) -> Counts:
        t = time.perf_counter()  # the moment the caller saw; the answers take a pipe round trip each
        return counts(t, self.store.ask("counts"), self.worker.ask("counts"))

    def quiesce(self) -> None:
        self.store.ask("quiesce")


@contextlib.asynccontextmanager
async def _process_cluster(s: Setup, data: Path) -> AsyncIterator[_Processes]:
    quiet = not logging.getLogger().isEnabledFor(logging.DEBUG)
    # all three interpreters start (import) at once; each then waits for its settings
    procs = {kind: _ServiceProcess(kind, quiet) for kind in ("router", "expert_store", "dense_worker")}
    try:
        rport = await asyncio.to_thread(procs["router"].start, _cluster_settings(s, data, 0, 0), None)
        sport = await asyncio.to_thread(procs["expert_store"].start, _cluster_settings(s, data, rport, 0),
                                        s.store_threads)
        await asyncio.to_thread(procs["dense_worker"].start, _cluster_settings(s, data, rport, sport), s.threads)
        yield _Processes(rport, procs["expert_store"], procs["dense_worker"])
    finally:
        for kind in ("dense_worker", "expert_store", "router"):
            await asyncio.to_thread(procs[kind].stop)


class _ServiceProcess:
    """One cluster service in a child process (spawned, so it shares nothing with this one),
    driven through a pipe: `start(settings, threads) -> port`, `ask("counts" | "quiesce")`,
    `stop()`. The child's answers are ("ok", value) or ("error", message)."""

    def __init__(self, kind: str, quiet: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(kind, child, quiet), name=f"bench-e2e-{kind}",
                                daemon=True)
        self.proc.start()
        child.close()

    def start(self, settings: Settings, threads: int | None) -> int:
        self.conn.send((settings, threads))
        return int(self._reply(CHILD_START_S))

    def ask(self, what: str) -> Any:
        self.conn.send(what)
        return self._reply(CHILD_REPLY_S)

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise Unavailable(f"bench e2e: the {self.kind} process exited ({self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise Unavailable(f"bench e2e: the {self.kind} process did not answer within {timeout_s:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise Unavailable(f"bench e2e: the {self.kind} process: {value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _child_main(kind: str, conn: Connection, quiet: bool) -> None:
    """A service process of `_process_cluster`: its server, then its counters on request until
    told to stop (or until the parent goes away: the pipe closes)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {kind} %(name)s: %(message)s")
    if quiet:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings, threads = conn.recv()
    except EOFError:
        return
    try:
        asyncio.run(_child_serve(kind, settings, threads, conn))
    except Exception as e:  # the parent says it, naming this service
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))


async def _child_serve(kind: str, settings: Settings, threads: int | None, conn: Connection) -> None:
    from services.dense_worker.server import create_server as create_worker
    from services.expert_store.server import create_server as create_store
    from services.router.server import create_server as create_router

    server: Any
    if kind == "router":
        server, port = create_router(settings, "127.0.0.1:0")
    elif kind == "expert_store":
        server, port = create_store(settings, "127.0.0.1:0", threads=threads)
    else:
        server, port = create_worker(settings, "127.0.0.1:0", register=True, threads=threads)
    try:
        await server.start()
        handlers: dict[str, Callable[[], Any]] = {}
        if kind == "expert_store":
            core = server.core
            handlers = {"counts": lambda: store_counts(core), "quiesce": lambda: _quiesce(core.tier_stats)}
        elif kind == "dense_worker":
            await _registered(server)
            model = server.core.model
            model.experts = TimedExperts(model.experts)
            handlers = {"counts": lambda: model_counts(model)}
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        conn.send(("ok", port))
        # a plain thread blocks on the pipe (the loop never does); it runs nothing on the loop
        threading.Thread(target=_answer, args=(conn, handlers, loop, stop), daemon=True,
                         name=f"bench-e2e-{kind}-pipe").start()
        await stop.wait()
    finally:
        await server.stop(0)


def _answer(conn: Connection, handlers: dict[str, Callable[[], Any]], loop: asyncio.AbstractEventLoop,
            stop: asyncio.Event) -> None:
    while True:
        try:
            what = conn.recv()
        except (EOFError, OSError):
            what = "stop"
        if what == "stop":
            loop.call_soon_threadsafe(stop.set)
            return
        fn = handlers.get(what)
        try:
            conn.send(("ok", fn() if fn is not None else {}))
        except Exception as e:
            conn.send(("error", f"{what}: {type(e).__name__}: {e}"))


def _cluster_settings(s: Setup, data: Path, router_port: int, store_port: int) -> Settings:
    st = s.settings
    return st.model_copy(update={
        "data_dir": data,
        "router": st.router.model_copy(update={"bind": "127.0.0.1:0", "address": f"127.0.0.1:{router_port}",
                                               "metrics_port": 0}),
        "expert_store": st.expert_store.model_copy(update={"bind": "127.0.0.1:0", "metrics_port": 0,
                                                           "address": f"127.0.0.1:{store_port}"}),
        "dense_worker": st.dense_worker.model_copy(update={"bind": "127.0.0.1:0", "address": "127.0.0.1:0",
                                                           "metrics_port": 0}),
    })


# ---- the report ------------------------------------------------------------------------------
def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _system(trials: list[Trial]) -> dict[str, Any]:
    out: dict[str, Any] = {"s_per_token": _spread([t.s_per_token for t in trials]),
                           "start_s": _spread([t.start_s for t in trials])}
    for i, name in enumerate(("cold", "warm")):
        reqs = [t.requests[i] for t in trials]
        d = [r.decode for r in reqs]
        out[name] = {
            "ttft_s": _spread([r.ttft_s for r in reqs]),
            "decode_tok_s": _spread([r.tok_s for r in reqs]),
            "s_per_token": _spread([p.s_per_token for p in d]),
            "bound_s": _spread([p.bound_s for p in d]),
            "disk_bound_s": _spread([p.disk_bound_s for p in d]),
            "memory_bound_s": _spread([p.memory_bound_s for p in d]),
            "bound_over_time": _spread([p.bound_s / p.s_per_token for p in d]),
            "hit_rate": _spread([p.hit_rate for p in d]),
            "missed_mb_per_token": _spread([p.missed_bytes / 1e6 for p in d]),
            "read_mb_per_token": _spread([p.read_bytes / 1e6 for p in d]),
            "touched_mb_per_token": _spread([p.touched_bytes / 1e6 for p in d]),
            "prefetch_recall": _spread([p.recall for p in d]),
            "prefill_missed_mb": _spread([r.prefill_missed_bytes / 1e6 for r in reqs]),
            "expert_s": _spread([p.expert_s for p in d]),
            "hint_s": _spread([p.hint_s for p in d]),
            "read_wait_s": _spread([p.read_wait_s for p in d]),
            "rest_s": _spread([p.s_per_token - p.expert_s - p.hint_s for p in d]),
        }
        if trials[0].kind == "cluster":
            out[name]["hops"] = {
                "worker_step_s": _spread([r.worker_step_s for r in reqs]),
                "store_s": _spread([p.store_s for p in d]),
                "store_load_s": _spread([p.store_load_s for p in d]),
                "call_s": _spread([p.call_s for p in d]),
                "rpc_hop_s": _spread([p.call_s - p.store_s for p in d]),
                "stream_hop_s": _spread([p.s_per_token - r.worker_step_s for p, r in zip(d, reqs, strict=True)]),
            }
    return out


def summarize(s: Setup, args: argparse.Namespace, rounds: list[dict[str, Any]], root: bool) -> dict[str, Any]:
    eng = [r["engine"] for r in rounds]
    clu = [r["cluster"] for r in rounds]
    ratios = [r["cluster"].s_per_token / r["engine"].s_per_token for r in rounds]
    ref = eng[0].requests[0].tokens
    match = all(q.tokens == ref for t in eng + clu for q in t.requests)
    hop = statistics.median(ratios)
    return {
        "name": "e2e", "model": str(s.model), "budget": args.budget, "budget_bytes": s.config.budget_bytes,
        "policy": s.config.policy, "batch": 1, "prompt_tokens": len(s.prompt), "tokens": s.tokens,
        "record_bytes": s.record_bytes, "dense_step_bytes": s.dense_step_bytes,
        "queue_depth": s.settings.storage.queue_depth, "page_cache_dropped": root,
        "threads": s.threads, "store_threads": s.store_threads,
        "cluster_processes": s.processes,
        "fio_gbps": _spread([t.fio_gbps for t in eng + clu]),
        "memory_gbps": _spread([t.memory_gbps for t in eng + clu]),
        "engine": _system(eng), "cluster": _system(clu),
        "hop_overhead": hop, "hop_overhead_rounds": ratios, "ratio": hop, "target": TARGET,
        "tokens_match": match,
        "rounds": [{"order": r["order"], **{k: _trial_json(r[k]) for k in ("engine", "cluster")}} for r in rounds],
    }


def _trial_json(t: Trial) -> dict[str, Any]:
    return {"fio_gbps": t.fio_gbps, "memory_gbps": t.memory_gbps, "start_s": t.start_s,
            "s_per_token": t.s_per_token,
            "requests": [{**{k: v for k, v in asdict(r).items() if k != "tokens"},
                          "decode_tok_s": r.tok_s, "bound_s": r.decode.bound_s} for r in t.requests]}


def _fmt(x: dict[str, float], scale: float = 1.0, f: str = ".3f") -> str:
    return (f"{x['median'] * scale:{f}} [{x['min'] * scale:{f}}-{x['max'] * scale:{f}}]")


def _print(o: dict[str, Any]) -> None:
    print(f"moetier bench e2e: {o['model']}, expert budget {o['budget']} ({o['budget_bytes'] / 1e9:.2f} GB), "
          f"policy {o['policy']}, batch 1, {o['prompt_tokens']} prompt + {o['tokens']} generated tokens per "
          f"request, {len(o['rounds'])} rounds (ABBA); page cache {'dropped' if o['page_cache_dropped'] else 'NOT dropped (not root)'} "
          "before each trial")
    where = "a process each, as `moetier up`" if o["cluster_processes"] else "all in this process (--in-process)"
    print(f"cluster services: {where}; kernel threads: engine {o['threads']}, dense worker {o['threads']}, "
          f"expert store {o['store_threads']}")
    print(f"bounds measured before each trial: fio {_fmt(o['fio_gbps'])} GB/s (randread O_DIRECT, bs "
          f"{o['record_bytes']} = record, iodepth {o['queue_depth']}); memory {_fmt(o['memory_gbps'], f='.1f')} "
          f"GB/s (numpy copy); dense bytes per step {o['dense_step_bytes'] / 1e6:.0f} MB")
    print("figures: median [min-max] over rounds")
    for kind in ("engine", "cluster"):
        sysd = o[kind]
        print(f"\n{kind}: start {_fmt(sysd['start_s'], f='.1f')} s")
        for name in ("cold", "warm"):
            r = sysd[name]
            print(f"  {name}: TTFT {_fmt(r['ttft_s'], f='.2f')} s (prompt read {_fmt(r['prefill_missed_mb'], f='.0f')} "
                  f"MB), decode {_fmt(r['decode_tok_s'], f='.2f')} tok/s, hit rate {_fmt(r['hit_rate'], f='.2f')}, "
                  f"prefetch recall {_fmt(r['prefetch_recall'], f='.2f')}")
            print(f"        per step {_fmt(r['s_per_token'], 1e3, '.0f')} ms beside its bound "
                  f"{_fmt(r['bound_s'], 1e3, '.0f')} ms (bound / time {_fmt(r['bound_over_time'], f='.2f')}): "
                  f"disk {_fmt(r['disk_bound_s'], 1e3, '.0f')} ms = {_fmt(r['missed_mb_per_token'], f='.0f')} MB "
                  f"missed (read {_fmt(r['read_mb_per_token'], f='.0f')}); memory {_fmt(r['memory_bound_s'], 1e3, '.0f')}"
                  f" ms = {_fmt(r['touched_mb_per_token'], f='.0f')} MB touched")
            print(f"        of which: experts (moe calls) {_fmt(r['expert_s'], 1e3, '.0f')} ms (the tier waiting for "
                  f"reads {_fmt(r['read_wait_s'], 1e3, '.0f')} ms), prefetch hints "
                  f"{_fmt(r['hint_s'], 1e3, '.1f')} ms, the rest (attention, gates, dense, lm_head, sampling) "
                  f"{_fmt(r['rest_s'], 1e3, '.0f')} ms")
            if "hops" in r:
                h = r["hops"]
                print(f"        hops: the store's own load + kernels {_fmt(h['store_s'], 1e3, '.0f')} ms (load "
                      f"{_fmt(h['store_load_s'], 1e3, '.0f')}) of the ComputeExperts round trips "
                      f"{_fmt(h['call_s'], 1e3, '.0f')} ms (the shared experts overlap them) -> RPC hop "
                      f"{_fmt(h['rpc_hop_s'], 1e3, '.1f')} ms; worker step "
                      f"{_fmt(h['worker_step_s'], 1e3, '.0f')} ms -> router + stream hop "
                      f"{_fmt(h['stream_hop_s'], 1e3, '.1f')} ms")
    rounds = ", ".join(f"{x:.3f}" for x in o["hop_overhead_rounds"])
    print(f"\ntokens equal (cluster vs engine, temperature 0): {'yes' if o['tokens_match'] else 'NO'}")
    print(f"hop_overhead = cluster / engine decode time per token = {o['hop_overhead']:.3f} "
          f"(rounds: {rounds})   target <= {o['target']}")
