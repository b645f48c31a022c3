"""`moetier bench e2e`: decode through the cluster beside the in-process engine, each beside its bounds.

The model is the benchmark model (mini-glm; `--model DIR` for another) with an expert RAM tier
of `--budget` (default 25%) of its expert bytes. Two systems serve it, alternately (ABBA order
over `--rounds`, so disk drift hits both):

  * engine: the in-process reference (`moetier.engine`: resident dense part, FastOps,
    `TieredExperts`), its tier configured exactly as the expert store configures its own
    (`tier_config`: budget, policy, prefetch bound; the store's queue depth and O_DIRECT);
  * cluster: router -> dense worker -> expert store started as `moetier up` starts them
    (`moetier.bench._cluster`: the same commands and one config file, a process each, default
    kernel threads), the request sent to the router's Generate as the gateway sends it. The
    worker's prefix cache is off, so the second request is prefilled like the first.

Both are observed only through their own interfaces: the engine through the library objects'
stats (the tier's, the tier-compute loop's, the model's prefetch prediction), the cluster
through its services' /metrics, the Generate stream's per-token timings, and the CPU time of
each process (/proc/<pid>/stat).

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
  * bound = max(disk, memory): reads and compute overlap (DESIGN.md, performance model);
  * CPU busy = CPU seconds of the system's processes during decode (the engine: this process;
    the cluster: its three services) / (decode seconds x the CPUs this process may use); beside
    it the system's CPU seconds per token, its run-queue wait (seconds its threads were
    runnable but waited for a CPU, /proc/<pid>/task/*/schedstat, over the same decode seconds x
    CPUs) and the machine's busy share of those CPUs (/proc/stat, every process): on a shared
    machine the difference is what others took, and 1 - that share is what was left idle.

Also the prefetch recall (hinted experts the layer then used / experts it used) and where the
time goes: the model's wait on its expert provider (engine: the tier-compute loop's pins, read
waits and kernels; cluster: the worker's wait on ComputeExperts), the tier's wait for reads,
and for the cluster the hops: the store's own load + kernel time of the calls, their round
trips (the difference is the RPC hop; per call too), and the client's time per token beyond
the worker's step (the router and stream hop).

With `--stores N` (N > 1) a third system runs in every round: the cluster with its experts
sharded over N expert stores, each on a directory of its own holding the expert files of every
N-th MoE layer (`moetier.bench._cluster.shard_dirs`), placed by the router's map; its decode
tok/s is printed beside the one-store cluster's, with the bytes each store read from disk (per
decode token and over the trial). Its tokens must equal the others' too.

`hop_overhead` (also `ratio`): decode time per token through the cluster / through the engine,
both requests pooled, median over rounds (each round's two trials adjacent in time). Target
<= 1.15. The cluster's tokens must equal the engine's (temperature 0); `tokens_match` says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moetier.bench import models
from moetier.bench._cluster import LocalCluster, Sample, machine_busy_s, process_wait_s, total
from moetier.bench.compute import copy_gbps
from moetier.bench.io import _drop_page_cache, _fio_pass, find_fio
from moetier.errors import InvalidArgument
from moetier.kernels.fast import default_threads
from moetier.settings import Settings, apply_kernel_settings, load_settings
from moetier.store.stats import TierStats
from moetier.store.tier import TierConfig

log = logging.getLogger(__name__)

TARGET = 1.15
QUIESCE_S = 2.0  # wait this long at most for prefetch reads in flight before the final count
QUIET_LOGGERS = ("moetier.store", "moetier.engine")


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
    p.add_argument("--fio-records", type=int, default=64, help="records fio reads per trial (default 64)")
    p.add_argument("--copy-mb", type=int, default=512, help="size of the memory bandwidth copy (default 512 MiB)")
    p.add_argument("--no-local-lane", action="store_true", help="the dense worker calls the expert store over gRPC "
                   "only (inference.local_lane false), not over its local lane")
    p.add_argument("--stores", type=int, default=1, help="also run the cluster with its experts sharded over this "
                   "many expert stores, one directory each (default 1: not run)")
    p.add_argument("--probe-calls", type=int, default=100, help="ComputeExperts calls of the round-trip probe, per "
                   "transport and cluster trial (default 100)")
    p.set_defaults(func=run)


# ---- counters ------------------------------------------------------------------------------
@dataclass
class Counts:
    """Monotonic counters at one moment (tier, I/O, the model's prefetch prediction, expert calls)."""

    t: float
    cpu_s: float = 0.0  # CPU seconds of the system's processes
    wait_s: float = 0.0  # seconds the system's threads were runnable but waited for a CPU
    machine_s: float = 0.0  # busy CPU seconds of the CPUs this process may use, whoever ran (/proc/stat)
    hits: int = 0
    misses: int = 0
    submitted: int = 0  # distinct reads submitted (demand + prefetch)
    read_bytes: int = 0
    pf_issued: int = 0
    pf_useful: int = 0
    predicted: int = 0  # the model's prefetch prediction: experts hinted
    actual: int = 0  # experts the layers then used
    pf_hits: int = 0  # hinted and used
    read_wait_s: float = 0.0  # the tier's wait for demanded experts' reads (calls with misses)
    store_load_s: float = 0.0  # cluster: the store's time pinning the calls' unions and waiting for reads
    store_compute_s: float = 0.0  # cluster: the store's kernel time
    expert_s: float = 0.0  # the model's wait on its expert provider (the tier-compute loop, or the RPC)
    call_s: float = 0.0  # the provider's calls from start to answer (cluster: the ComputeExperts round
    # trips, which the shared expert overlaps; engine: the same as expert_s)
    calls: int = 0  # expert provider calls (one per MoE layer per step)

    def __sub__(self, o: Counts) -> Counts:
        return Counts(**{k: getattr(self, k) - getattr(o, k) for k in self.__dataclass_fields__})


def tier_counts(tier: TierStats) -> dict[str, Any]:
    """The engine tier's part of `Counts`."""
    io = tier.io
    return {"hits": sum(tier.hits.values()), "misses": sum(tier.misses.values()),
            "submitted": io.submitted if io else 0, "read_bytes": io.bytes if io else 0,
            "pf_issued": tier.prefetch_issued, "pf_useful": tier.prefetch_useful, "read_wait_s": tier.miss_wait.sum}


def store_counts(m: Sample) -> dict[str, Any]:
    """The expert store's part of `Counts`, from its /metrics."""
    es = "moetier_expert_store_"
    return {"hits": int(total(m, es + "hits_total")), "misses": int(total(m, es + "misses_total")),
            "submitted": int(total(m, es + "reads_submitted_total")),
            "read_bytes": int(total(m, es + "disk_read_bytes_total")),
            "pf_issued": int(total(m, es + "prefetch_queued_total")),
            "pf_useful": int(total(m, es + "prefetch_useful_total")),
            "read_wait_s": m.get(es + "miss_wait_seconds_sum", 0.0),
            "store_load_s": m.get(es + "load_seconds_sum", 0.0),
            "store_compute_s": m.get(es + "compute_seconds_sum", 0.0)}


def worker_counts(m: Sample) -> dict[str, Any]:
    """The dense worker's part of `Counts`, from its /metrics."""
    dw = "moetier_dense_worker_"
    return {"predicted": int(total(m, dw + "prefetch_predicted_experts_total")),
            "actual": int(total(m, dw + "prefetch_actual_experts_total")),
            "pf_hits": int(total(m, dw + "prefetch_hit_experts_total")),
            "expert_s": m.get(dw + "step_phase_seconds_sum{phase=expert}", 0.0),
            "call_s": m.get(dw + "expert_call_seconds_sum", 0.0),
            "calls": int(total(m, dw + "expert_call_seconds_count"))}


def counts(t: float, cpu_s: float, wait_s: float, *parts: dict[str, Any]) -> Counts:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return Counts(t, cpu_s, wait_s, machine_busy_s(), **merged)


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
    cpu_busy: float  # CPU seconds / (seconds x CPUs)
    cpu_wait: float  # run-queue seconds of the system's threads / (seconds x CPUs): wanted, not given
    machine_busy: float  # CPU busy of every process on those CPUs (the system and whatever else ran)
    cpu_s: float  # per step: the system's CPU seconds
    expert_s: float  # per step: the model's wait on its expert provider
    store_s: float  # cluster, per step: the store's load + kernel time (0 for the engine)
    read_wait_s: float  # per step: the tier's wait for demanded reads (within expert_s, or store_s)
    store_load_s: float  # cluster, per step: the store's load time alone (pins, waits for reads)
    call_s: float  # per step: the provider's calls from start to answer
    calls: float  # per step: provider calls

    @property
    def s_per_token(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def bound_s(self) -> float:
        return max(self.disk_bound_s, self.memory_bound_s)

    @property
    def hop_per_call_s(self) -> float:
        """Cluster: a ComputeExperts round trip beyond the store's own time, per call."""
        return (self.call_s - self.store_s) / self.calls if self.calls else 0.0


def phase(d: Counts, steps: int, record: int, dense_step: int, fio_gbps: float, mem_gbps: float,
          cpus: int) -> Phase:
    steps = max(1, steps)
    demanded = d.hits + d.misses
    missed = (d.submitted - d.pf_issued) + d.pf_useful  # demand reads + prefetch reads then used
    missed_b = missed * record / steps
    touched_b = demanded * record / steps + dense_step
    return Phase(steps, d.t, d.hits / demanded if demanded else 0.0, missed_b, d.read_bytes / steps, touched_b,
                 missed_b / (fio_gbps * 1e9), touched_b / (mem_gbps * 1e9),
                 d.pf_hits / d.actual if d.actual else 0.0, d.cpu_s / (d.t * cpus) if d.t > 0 else 0.0,
                 d.wait_s / (d.t * cpus) if d.t > 0 else 0.0, d.machine_s / (d.t * cpus) if d.t > 0 else 0.0,
                 d.cpu_s / steps,
                 d.expert_s / steps, (d.store_load_s + d.store_compute_s) / steps, d.read_wait_s / steps,
                 d.store_load_s / steps, d.call_s / steps, d.calls / steps)


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
    probe: dict[str, float] = field(default_factory=dict)  # cluster: the ComputeExperts round-trip probe
    # sharded: per store, bytes read from disk during the requests' decode steps, and over the trial
    store_decode_bytes: dict[str, float] = field(default_factory=dict)
    store_bytes: dict[str, float] = field(default_factory=dict)

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
    cpus: int  # CPUs this process (and the services it starts) may use
    record_bytes: int
    dense_step_bytes: int
    expert_files: list[Path]
    fio: str
    fio_records: int
    copy: tuple[np.ndarray, np.ndarray]
    probe_calls: int
    stores: int = 1  # > 1: the sharded cluster runs too


def run(args: argparse.Namespace) -> int:
    fio = find_fio("e2e", "the disk bound is measured with it")
    if fio is None:
        return 2
    if args.tokens < 2 or args.prompt_tokens < 1 or args.rounds < 1 or args.fio_records < 1 or args.stores < 1:
        raise InvalidArgument("--tokens must be >= 2; --prompt-tokens, --rounds, --fio-records and --stores >= 1")
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    setup = prepare(args, fio)
    root = os.geteuid() == 0
    rounds = []
    for r in range(args.rounds):
        kinds = ("engine", "cluster", "sharded") if setup.stores > 1 else ("engine", "cluster")
        order = kinds if r % 2 == 0 else kinds[::-1]
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
    from moetier.store.tier import tier_config
    from moetier.text.tokenizer import TextTokenizer
    from moetier.weights.container import Container

    model = models.resolve_model(args)
    overrides: dict[str, Any] = {"model": {"path": str(model), "expert_cache": args.budget},
                                 # speculation off: the engine beside it decodes without drafts (bench spec
                                 # measures drafting)
                                 "inference": {"prefix_cache_bytes": "0", "local_lane": not args.no_local_lane,
                                               "speculative_tokens": 0},
                                 # every system starts with a cold tier, as the engine beside it does: a
                                 # trial measures its own reads
                                 "storage": {"preload": False}}
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
        files = [c.index.root / f for f in c.index.files]
        prompt = models.prompt_ids(TextTokenizer.from_dir(model), args.prompt_tokens)
        if len(prompt) + args.tokens > c.args.max_position_embeddings:
            raise InvalidArgument(f"--prompt-tokens + --tokens exceed the model's {c.args.max_position_embeddings}")
    src = np.ones(max(1, args.copy_mb) << 18, dtype=np.float32)  # copy_mb MiB
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    return Setup(model, settings, config, prompt, args.tokens, default_threads(), record, dense, files, fio,
                 args.fio_records, (src, dst), args.probe_calls, args.stores)


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
        _cluster_trial(s, t)
    return t


def _quiesce(loading_bytes: Any) -> None:
    deadline = time.monotonic() + QUIESCE_S
    while loading_bytes() and time.monotonic() < deadline:
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
        ops = make_ops(False)
        experts = TieredExperts.open(container, ops, s.config, depth=st.queue_depth, direct=st.direct_io)
        engine = Engine(container, Model(container.args, load_dense(container), ops, experts), experts)
    except BaseException:
        container.close()
        raise
    with engine:
        warmup()
        t.start_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=s.tokens, ignore_eos=True)
        tier = engine.experts.tier

        def now() -> Counts:
            c = engine.experts.stats()
            pf = engine.model.stats.prefetch
            return counts(time.perf_counter(), time.process_time(), process_wait_s(os.getpid()),
                          tier_counts(tier.stats()),
                          {"predicted": pf.predicted, "actual": pf.actual, "pf_hits": pf.hits,
                           "expert_s": c.load_s + c.compute_s, "call_s": c.load_s + c.compute_s,
                           "calls": c.calls})

        for _ in range(2):
            before = now()
            first: Counts | None = None
            toks: list[int] = []
            for g in engine.generate(s.prompt, params, chunk_size=s.settings.inference.prefill_chunk):
                toks.append(g.token)
                if first is None:
                    first = now()
            end = now()  # decode ends with the last token (reads still in flight are counted in neither request)
            _quiesce(lambda: tier.stats().loading_bytes)
            assert first is not None
            t.requests.append(_request(s, t, toks, before, first, end))


def _request(s: Setup, t: Trial, toks: list[int], before: Counts, first: Counts, end: Counts,
             worker_step_s: float = 0.0) -> Request:
    pre = first - before
    steps = len(toks) - 1
    pre_missed = ((pre.submitted - pre.pf_issued) + pre.pf_useful) * s.record_bytes
    return Request(toks, pre.t, phase(end - first, steps, s.record_bytes, s.dense_step_bytes, t.fio_gbps,
                                      t.memory_gbps, s.cpus), pre_missed, worker_step_s / steps)


def _cluster_trial(s: Setup, t: Trial) -> None:
    import grpc

    from moetier.rpc.v1 import generate_pb2, router_pb2_grpc

    t0 = time.perf_counter()
    # beside the model: the sharded stores' directories are hard links to its files
    data = Path(tempfile.mkdtemp(prefix="moetier-bench-e2e-", dir=s.model.parent if t.kind == "sharded" else None))
    stores = s.stores if t.kind == "sharded" else 1
    read = "moetier_expert_store_disk_read_bytes_total"
    try:
        with LocalCluster.start(s.settings, s.model, data, stores=stores) as cluster, \
                grpc.insecure_channel(cluster.router_address) as channel, ThreadPoolExecutor(2) as pool:
            t.start_s = time.perf_counter() - t0
            stub = router_pb2_grpc.RouterStub(channel)

            def now() -> Counts:
                # the moment the client saw; both services scraped at once (the decode goes on meanwhile,
                # a scrape is milliseconds against a step of the benchmark model's hundreds)
                at, cpu, wait = time.perf_counter(), cluster.cpu_seconds(), cluster.wait_seconds()
                store, worker = pool.map(cluster.scrape, ("expert_store", "dense_worker"))
                return counts(at, cpu, wait, store_counts(store), worker_counts(worker))

            def per_store() -> dict[str, float]:
                return {sid: total(m, read) for sid, m in cluster.scrape_each("expert_store").items()}

            at_start = per_store()
            for i in range(2):
                req = generate_pb2.GenerateRequest(
                    request_id=f"bench-e2e-{i}", prompt_ids=s.prompt,
                    sampling=generate_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=s.tokens))
                before = now()
                first: Counts | None = None
                toks: list[int] = []
                step_ns = 0
                decode_from: dict[str, float] = {}
                for m in stub.Generate(req, timeout=3600):
                    toks.extend(tok.token_id for tok in m.tokens)
                    if first is None:
                        first = now()
                        decode_from = per_store()
                    else:  # decode steps: the worker's own clock
                        step_ns += m.timings.step_ns
                end = now()
                for sid, n in per_store().items():
                    t.store_decode_bytes[sid] = t.store_decode_bytes.get(sid, 0.0) + n - decode_from.get(sid, 0.0)
                _quiesce(lambda: cluster.scrape("expert_store").get("moetier_expert_store_loading_bytes", 0.0))
                assert first is not None
                t.requests.append(_request(s, t, toks, before, first, end, step_ns / 1e9))
            t.store_bytes = {sid: n - at_start.get(sid, 0.0) for sid, n in per_store().items()}
            if s.probe_calls > 0 and t.kind == "cluster":
                t.probe = hop_probe(cluster.settings.expert_store.address, s.probe_calls)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def hop_probe(address: str, calls: int) -> dict[str, float]:
    """The ComputeExperts round trip from this process to the store, beyond the store's own time
    (its load_ns + compute_ns), over gRPC and over the local lane, alternating call by call: one
    decode row of the first MoE layer routed to its first K experts (resident after the first call).
    Medians in seconds; the store's own time beside them."""
    import grpc

    from moetier.rpc.local import LocalClient
    from moetier.rpc.tensors import to_pb
    from moetier.rpc.v1 import expert_store_pb2 as pb
    from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ExpertStoreStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=30)
        x = np.ones((1, info.hidden_size), dtype=np.float32)  # [T, D]
        ids = np.arange(info.top_k, dtype=np.int32).reshape(1, -1)  # [T, K]
        w = np.full(ids.shape, 1.0 / info.top_k, dtype=np.float32)
        layer = info.moe_layers[0]
        req = pb.ComputeExpertsRequest(layer=layer, hidden=to_pb(x), expert_ids=to_pb(ids), weights=to_pb(w))
        lane = LocalClient.connect(info.local_socket, info.local_token) if info.local_socket else None
        rt: dict[str, list[float]] = {"grpc": [], "lane": []}
        own: dict[str, list[float]] = {"grpc": [], "lane": []}
        try:
            stub.ComputeExperts(req, timeout=60)  # the experts resident
            for _ in range(calls):
                t0 = time.perf_counter()
                r = stub.ComputeExperts(req, timeout=60)
                rt["grpc"].append(time.perf_counter() - t0)
                own["grpc"].append((r.load_ns + r.compute_ns) / 1e9)
                if lane is not None:
                    t0 = time.perf_counter()
                    r, _ = lane.compute(pb.ComputeExpertsRequest(layer=layer), x, ids, w, 60)
                    rt["lane"].append(time.perf_counter() - t0)
                    own["lane"].append((r.load_ns + r.compute_ns) / 1e9)
        finally:
            if lane is not None:
                lane.close()
    out: dict[str, float] = {}
    for kind in ("grpc", "lane"):
        if rt[kind]:
            out[f"{kind}_round_trip_s"] = statistics.median(rt[kind])
            out[f"{kind}_store_s"] = statistics.median(own[kind])
            out[f"{kind}_hop_s"] = statistics.median(a - b for a, b in zip(rt[kind], own[kind], strict=True))
    return out


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
            "cpu_busy": _spread([p.cpu_busy for p in d]),
            "cpu_wait": _spread([p.cpu_wait for p in d]),
            "machine_busy": _spread([p.machine_busy for p in d]),
            "cpu_s_per_token": _spread([p.cpu_s for p in d]),
            "expert_s": _spread([p.expert_s for p in d]),
            "read_wait_s": _spread([p.read_wait_s for p in d]),
            "rest_s": _spread([p.s_per_token - p.expert_s for p in d]),
        }
        if trials[0].kind != "engine":
            out[name]["hops"] = {
                "worker_step_s": _spread([r.worker_step_s for r in reqs]),
                "store_s": _spread([p.store_s for p in d]),
                "store_load_s": _spread([p.store_load_s for p in d]),
                "call_s": _spread([p.call_s for p in d]),
                "rpc_hop_s": _spread([p.call_s - p.store_s for p in d]),
                "rpc_hop_per_call_s": _spread([p.hop_per_call_s for p in d]),
                "calls_per_token": _spread([p.calls for p in d]),
                "stream_hop_s": _spread([p.s_per_token - r.worker_step_s for p, r in zip(d, reqs, strict=True)]),
            }
    return out


def summarize(s: Setup, args: argparse.Namespace, rounds: list[dict[str, Any]], root: bool) -> dict[str, Any]:
    eng = [r["engine"] for r in rounds]
    clu = [r["cluster"] for r in rounds]
    sha = [r["sharded"] for r in rounds if "sharded" in r]
    ratios = [r["cluster"].s_per_token / r["engine"].s_per_token for r in rounds]
    ref = eng[0].requests[0].tokens
    match = all(q.tokens == ref for t in eng + clu + sha for q in t.requests)
    hop = statistics.median(ratios)
    steps = sum(len(q.tokens) - 1 for q in clu[0].requests) if clu else 1
    sharded: dict[str, Any] = {}
    if sha:
        sharded = {"stores": s.stores, **_system(sha),
                   "decode_tok_s_over_one_store": statistics.median(
                       r["cluster"].s_per_token / r["sharded"].s_per_token for r in rounds),
                   "read_mb_per_decode_token": {sid: _spread([t.store_decode_bytes[sid] / 1e6 / steps for t in sha])
                                                for sid in sha[0].store_decode_bytes},
                   "read_mb_per_trial": {sid: _spread([t.store_bytes[sid] / 1e6 for t in sha])
                                         for sid in sha[0].store_bytes},
                   "one_store_read_mb_per_trial": {sid: _spread([t.store_bytes[sid] / 1e6 for t in clu])
                                                   for sid in clu[0].store_bytes}}
    return {
        "name": "e2e", "model": str(s.model), "budget": args.budget, "budget_bytes": s.config.budget_bytes,
        "policy": s.config.policy, "batch": 1, "prompt_tokens": len(s.prompt), "tokens": s.tokens,
        "record_bytes": s.record_bytes, "dense_step_bytes": s.dense_step_bytes,
        "queue_depth": s.settings.storage.queue_depth, "page_cache_dropped": root,
        "cpus": s.cpus, "local_lane": s.settings.inference.local_lane,
        "probe": {k: _spread([t.probe[k] for t in clu if k in t.probe]) for k in (clu[0].probe if clu else {})},
        "fio_gbps": _spread([t.fio_gbps for t in eng + clu]),
        "memory_gbps": _spread([t.memory_gbps for t in eng + clu]),
        "engine": _system(eng), "cluster": _system(clu), **({"sharded": sharded} if sharded else {}),
        "hop_overhead": hop, "hop_overhead_rounds": ratios, "ratio": hop, "target": TARGET,
        "tokens_match": match,
        "rounds": [{"order": r["order"], **{k: _trial_json(r[k]) for k in ("engine", "cluster", "sharded") if k in r}}
                   for r in rounds],
    }


def _trial_json(t: Trial) -> dict[str, Any]:
    return {"fio_gbps": t.fio_gbps, "memory_gbps": t.memory_gbps, "start_s": t.start_s,
            "s_per_token": t.s_per_token, "probe": t.probe, "store_decode_bytes": t.store_decode_bytes,
            "store_bytes": t.store_bytes,
            "requests": [{**{k: v for k, v in asdict(r).items() if k != "tokens"},
                          "decode_tok_s": r.tok_s, "bound_s": r.decode.bound_s} for r in t.requests]}


def _fmt(x: dict[str, float], scale: float = 1.0, f: str = ".3f") -> str:
    return (f"{x['median'] * scale:{f}} [{x['min'] * scale:{f}}-{x['max'] * scale:{f}}]")


def _print(o: dict[str, Any]) -> None:
    print(f"moetier bench e2e: {o['model']}, expert budget {o['budget']} ({o['budget_bytes'] / 1e9:.2f} GB), "
          f"policy {o['policy']}, batch 1, {o['prompt_tokens']} prompt + {o['tokens']} generated tokens per "
          f"request, {len(o['rounds'])} rounds (ABBA); page cache {'dropped' if o['page_cache_dropped'] else 'NOT dropped (not root)'} "
          "before each trial")
    print(f"cluster services: a process each, started as `moetier up` starts them; the worker calls the store "
          f"over {'its local lane' if o['local_lane'] else 'gRPC only'}; {o['cpus']} CPUs")
    print(f"bounds measured before each trial: fio {_fmt(o['fio_gbps'])} GB/s (randread O_DIRECT, bs "
          f"{o['record_bytes']} = record, iodepth {o['queue_depth']}); memory {_fmt(o['memory_gbps'], f='.1f')} "
          f"GB/s (numpy copy); dense bytes per step {o['dense_step_bytes'] / 1e6:.0f} MB")
    print("figures: median [min-max] over rounds")
    for kind in ("engine", "cluster", "sharded"):
        if kind not in o:
            continue
        sysd = o[kind]
        title = f"sharded over {sysd['stores']} expert stores" if kind == "sharded" else kind
        print(f"\n{title}: start {_fmt(sysd['start_s'], f='.1f')} s")
        for name in ("cold", "warm"):
            r = sysd[name]
            print(f"  {name}: TTFT {_fmt(r['ttft_s'], f='.2f')} s (prompt read {_fmt(r['prefill_missed_mb'], f='.0f')} "
                  f"MB), decode {_fmt(r['decode_tok_s'], f='.2f')} tok/s, hit rate {_fmt(r['hit_rate'], f='.2f')}, "
                  f"prefetch recall {_fmt(r['prefetch_recall'], f='.2f')}, CPU busy {_fmt(r['cpu_busy'], f='.2f')} "
                  f"({_fmt(r['cpu_s_per_token'], 1e3, '.0f')} CPU ms per token; waiting for a CPU "
                  f"{_fmt(r['cpu_wait'], f='.2f')}; every process on those CPUs {_fmt(r['machine_busy'], f='.2f')})")
            print(f"        per step {_fmt(r['s_per_token'], 1e3, '.0f')} ms beside its bound "
                  f"{_fmt(r['bound_s'], 1e3, '.0f')} ms (bound / time {_fmt(r['bound_over_time'], f='.2f')}): "
                  f"disk {_fmt(r['disk_bound_s'], 1e3, '.0f')} ms = {_fmt(r['missed_mb_per_token'], f='.0f')} MB "
                  f"missed (read {_fmt(r['read_mb_per_token'], f='.0f')}); memory {_fmt(r['memory_bound_s'], 1e3, '.0f')}"
                  f" ms = {_fmt(r['touched_mb_per_token'], f='.0f')} MB touched")
            print(f"        of which: waiting on the routed experts {_fmt(r['expert_s'], 1e3, '.0f')} ms (the tier "
                  f"waiting for reads {_fmt(r['read_wait_s'], 1e3, '.0f')} ms), the rest (attention, gates, "
                  f"shared experts, dense, lm_head, sampling, hints) {_fmt(r['rest_s'], 1e3, '.0f')} ms")
            if "hops" in r:
                h = r["hops"]
                print(f"        hops: the store's own load + kernels {_fmt(h['store_s'], 1e3, '.0f')} ms (load "
                      f"{_fmt(h['store_load_s'], 1e3, '.0f')}) of the ComputeExperts round trips "
                      f"{_fmt(h['call_s'], 1e3, '.0f')} ms (the shared experts overlap them) -> RPC hop "
                      f"{_fmt(h['rpc_hop_s'], 1e3, '.1f')} ms ({_fmt(h['rpc_hop_per_call_s'], 1e3, '.2f')} ms per "
                      f"call, {_fmt(h['calls_per_token'], f='.0f')} calls); worker step "
                      f"{_fmt(h['worker_step_s'], 1e3, '.0f')} ms -> router + stream hop "
                      f"{_fmt(h['stream_hop_s'], 1e3, '.1f')} ms")
    pr = o["probe"]
    if pr:
        lane = (f"; local lane {_fmt(pr['lane_round_trip_s'], 1e3, '.3f')} ms, of which the hop "
                f"{_fmt(pr['lane_hop_s'], 1e3, '.3f')} ms" if "lane_hop_s" in pr else "")
        print(f"\nComputeExperts round trip, 1 row, experts resident (the store's own time "
              f"{_fmt(pr['grpc_store_s'], 1e3, '.3f')} ms): gRPC {_fmt(pr['grpc_round_trip_s'], 1e3, '.3f')} ms, "
              f"of which the hop {_fmt(pr['grpc_hop_s'], 1e3, '.3f')} ms{lane}")
    sh = o.get("sharded")
    if sh:
        one, two = o["cluster"], sh
        print(f"\ndecode tok/s, {sh['stores']} stores beside 1 store: cold {_fmt(two['cold']['decode_tok_s'], f='.2f')}"
              f" beside {_fmt(one['cold']['decode_tok_s'], f='.2f')}, warm {_fmt(two['warm']['decode_tok_s'], f='.2f')}"
              f" beside {_fmt(one['warm']['decode_tok_s'], f='.2f')} (speed-up, decode time per token pooled: "
              f"{sh['decode_tok_s_over_one_store']:.3f})")
        for sid in sorted(sh["read_mb_per_trial"]):
            print(f"  {sid}: read {_fmt(sh['read_mb_per_decode_token'][sid], f='.1f')} MB per decode token, "
                  f"{_fmt(sh['read_mb_per_trial'][sid], f='.0f')} MB over the trial")
        for sid in sorted(sh["one_store_read_mb_per_trial"]):
            print(f"  one store ({sid}): {_fmt(sh['one_store_read_mb_per_trial'][sid], f='.0f')} MB over the trial")
    rounds = ", ".join(f"{x:.3f}" for x in o["hop_overhead_rounds"])
    vs = "cluster and sharded cluster vs engine" if sh else "cluster vs engine"
    print(f"\ntokens equal ({vs}, temperature 0): {'yes' if o['tokens_match'] else 'NO'}")
    print(f"hop_overhead = cluster / engine decode time per token = {o['hop_overhead']:.3f} "
          f"(rounds: {rounds})   target <= {o['target']}")
