"""The soak: mixed traffic for a long time (30 minutes by default) with a fault now and then.

Traffic: `CONCURRENCY` requests always in flight, the workload's requests in turn (greedy ones
checked against the reference run). Faults: from the first minute, one every `fault_every`
seconds, in the order of `SOAK_FAULTS`, each injected, held, restored and followed to recovery
as in the matrix. A failed request counts as clean only when it overlaps a fault (from its
injection to 2 s after its recovery) and failed the way that fault allows; otherwise it is
wrong.

Sampled every 10 s: RSS, open fds and threads of every service (its current process). Reported
per window (5 minutes by default): requests, outcomes and errors by kind, p50/p99 time to first
token and inter-token latency of the streamed requests, each service's peak RSS, fds and threads.
The stated bounds, on the samples taken outside faults (a flood's or a burst's peaks are
transient; the window figures include them): a service's peak after the first window stays
within 1.25 x its first window's peak + 32 MiB (RSS), + 32 (fds), + 16 (threads)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from moetier.chaos.cluster import ChaosCluster
from moetier.chaos.faults import FAULTS, Ctx, Fault, worker_load
from moetier.chaos.harness import (
    DEADLINE_S,
    RECOVERY_LIMIT_S,
    Plan,
    Probe,
    healthy,
    inject_restore,
    reference_run,
)
from moetier.chaos.persist import Persisted
from moetier.chaos.workload import Outcome, check_tokens, run_one, workload

CONCURRENCY = 4
SAMPLE_S = 10.0
GRACE_S = 2.0
SOAK_FAULTS = ["flood", "cancel-burst", "kill-expert_store-restart", "term-dense_worker-restart", "mirror-removed",
               "corrupt-primary", "kill-router-restart", "slow-disk", "term-gateway-restart", "clock-jump-forward",
               "slow-reader", "kill-dense_worker-restart", "corrupt-mirror", "term-router-restart"]
RSS_FACTOR, RSS_SLACK, FD_SLACK, THREAD_SLACK = 1.25, 32 << 20, 32, 16
ANY_ALLOWED: frozenset[int | str] = frozenset().union(*(f.allowed for f in FAULTS.values()))


@dataclass
class Done:
    t0: float
    t1: float
    outcome: Outcome
    stream: bool
    kind: str = ""  # ok | clean | wrong | hung, after the fault windows are known


@dataclass
class FaultRun:
    name: str
    at: float
    until: float | None = None  # recovered (None: never)
    recovery_s: float | None = None
    lost: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)


async def _traffic(url: str, ref: dict[str, str], n: int, stop: asyncio.Event, done: list[Done]) -> None:
    specs = workload(n)
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(DEADLINE_S), limits=limits) as client:
        async def lane() -> None:
            while not stop.is_set():
                s = specs[next(counter) % len(specs)]
                t0 = time.monotonic()
                o = await run_one(client, s, ANY_ALLOWED, DEADLINE_S)
                check_tokens([s], [o], ref)
                done.append(Done(t0, time.monotonic(), o, s.stream))
                if o.kind != "ok":
                    await asyncio.sleep(0.25)  # a refused request does not spin

        await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))


async def _sampler(cluster: ChaosCluster, t0: float, stop: asyncio.Event, samples: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        t = time.monotonic() - t0
        for name, st in cluster.stats().items():
            if st is not None:
                samples.append({"t": round(t, 1), "service": name, "pid": cluster.pid(name), **st})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


async def _fault(cluster: ChaosCluster, f: Fault) -> FaultRun:
    await healthy(cluster, idle=False)
    ctx = Ctx(cluster)
    ctx.state["kv_baseline"] = None  # traffic keeps running: no KV baseline to return to
    before = Persisted.read(cluster.prefix_dir, cluster.history_path)
    run = FaultRun(f.name, time.monotonic())
    probe = Probe(cluster.url, run.at)
    probe.task = asyncio.ensure_future(probe.loop())
    await inject_restore(ctx, [f], f.hold_s)
    probe.restored_at = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.shield(probe.task), RECOVERY_LIMIT_S)
        run.recovery_s = probe.recovered()
        run.until = time.monotonic()
    except TimeoutError:
        probe.task.cancel()
    if f.check is not None:
        await f.check(ctx)
    run.checks = [{"check": w, "passed": p, "detail": d} for w, p, d in ctx.checks
                  if w != "the cluster let go of every request"]  # traffic keeps running meanwhile
    await asyncio.sleep(0.5)
    run.lost = before.lost(Persisted.read(cluster.prefix_dir, cluster.history_path), ctx.damaged)
    return run


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None


async def run_soak(root: Path, duration_s: float, window_s: float = 300.0, fault_every_s: float = 120.0,
                   echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    cluster = ChaosCluster(root)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, cluster.prepare)
        plan = Plan()
        ref, ref_row = await reference_run(cluster, plan)
        if ref_row.bad:
            raise RuntimeError(f"the reference run failed: {ref_row.failures[:3]}")
        await loop.run_in_executor(None, worker_load, cluster)
        t0 = time.monotonic()
        stop = asyncio.Event()
        done: list[Done] = []
        samples: list[dict[str, Any]] = []
        faults: list[FaultRun] = []
        traffic = asyncio.ensure_future(_traffic(cluster.url, ref, plan.during + plan.after, stop, done))
        sampler = asyncio.ensure_future(_sampler(cluster, t0, stop, samples))
        echo(f"soak: {duration_s:.0f} s, a fault every {fault_every_s:.0f} s, windows of {window_s:.0f} s")
        k = 0
        next_fault = t0 + min(60.0, fault_every_s)
        while time.monotonic() < t0 + duration_s:
            if time.monotonic() >= next_fault and time.monotonic() < t0 + duration_s - 30:
                f = FAULTS[SOAK_FAULTS[k % len(SOAK_FAULTS)]]
                k += 1
                run = await _fault(cluster, f)
                faults.append(run)
                echo(f"soak: {time.monotonic() - t0:7.0f} s  {f.name}: recovery "
                     f"{'never' if run.recovery_s is None else f'{run.recovery_s:.1f} s'}, lost {len(run.lost)}, "
                     f"{len(done)} requests so far")
                next_fault += fault_every_s
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(traffic, sampler)
        end = time.monotonic()
    finally:
        await loop.run_in_executor(None, cluster.close)
    return soak_report(done, samples, faults, t0, end, window_s, {f.name: FAULTS[f.name] for f in faults})


def _classify(d: Done, faults: list[FaultRun], known: dict[str, Fault], end: float) -> str:
    o = d.outcome
    if o.kind in ("ok", "hung", "wrong"):  # wrong whatever the fault: no envelope, a silent cut...
        return o.kind
    for run in faults:
        until = (run.until if run.until is not None else end) + GRACE_S
        if d.t0 <= until and d.t1 >= run.at and (o.status in known[run.name].allowed or (
                o.status is None and "transport" in known[run.name].allowed)):
            return "clean"
    return "wrong"


def soak_report(done: list[Done], samples: list[dict[str, Any]], faults: list[FaultRun], t0: float, end: float,
                window_s: float, known: dict[str, Fault]) -> dict[str, Any]:
    for d in done:
        d.kind = _classify(d, faults, known, end)
    n_windows = max(1, int(np.ceil((end - t0) / window_s)))
    windows = []
    services = sorted({s["service"] for s in samples})
    for w in range(n_windows):
        lo, hi = t0 + w * window_s, t0 + (w + 1) * window_s
        ds = [d for d in done if lo <= d.t1 < hi]
        ttft = [d.outcome.ttft_s for d in ds if d.kind == "ok" and d.stream and d.outcome.ttft_s is not None]
        itl = [x for d in ds if d.kind == "ok" and d.stream for x in d.outcome.itl_s]
        errors = Counter(f"{d.kind} {d.outcome.status or ''} {d.outcome.why[:60]}".strip()
                         for d in ds if d.kind != "ok")
        res: dict[str, Any] = {}
        for name in services:
            ss = [s for s in samples if s["service"] == name and lo - t0 <= s["t"] < hi - t0]
            if ss:
                res[name] = {"rss_mib_peak": round(max(s["rss_bytes"] for s in ss) / 2**20, 1),
                             "fds_peak": max(s["fds"] for s in ss), "threads_peak": max(s["threads"] for s in ss)}
        windows.append({"window": w, "from_s": round(w * window_s), "to_s": round(min(end - t0, (w + 1) * window_s)),
                        "requests": len(ds), "ok": sum(d.kind == "ok" for d in ds),
                        "clean": sum(d.kind == "clean" for d in ds), "wrong": sum(d.kind == "wrong" for d in ds),
                        "hung": sum(d.kind == "hung" for d in ds),
                        "tokens_wrong": sum(d.outcome.tokens_wrong for d in ds),
                        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
                        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
                        "errors": dict(errors.most_common(8)), "services": res})
    bounds = []

    def quiet(s: dict[str, Any]) -> bool:  # not during a fault: a flood's or a burst's peaks are transient
        return not any(f.at - t0 <= s["t"] <= (f.until if f.until is not None else end) - t0 + GRACE_S
                       for f in faults)

    for name in services:
        first = [s for s in samples if s["service"] == name and s["t"] < window_s and quiet(s)]
        later = [s for s in samples if s["service"] == name and s["t"] >= window_s and quiet(s)]
        if not first or not later:
            continue
        for key, limit in (("rss_bytes", lambda v: v * RSS_FACTOR + RSS_SLACK), ("fds", lambda v: v + FD_SLACK),
                           ("threads", lambda v: v + THREAD_SLACK)):
            base = max(s[key] for s in first)
            peak = max(s[key] for s in later)
            bounds.append({"service": name, "what": key, "first_window_peak": base, "later_peak": peak,
                           "bound": round(limit(base)), "within": peak <= limit(base)})
    totals = {"requests": len(done), "ok": sum(d.kind == "ok" for d in done),
              "clean": sum(d.kind == "clean" for d in done), "wrong": sum(d.kind == "wrong" for d in done),
              "hung": sum(d.kind == "hung" for d in done), "tokens_wrong": sum(d.outcome.tokens_wrong for d in done),
              "lost": sum(len(f.lost) for f in faults), "faults": len(faults),
              "not_recovered": sum(f.recovery_s is None for f in faults),
              "checks_failed": sum(not c["passed"] for f in faults for c in f.checks)}
    wrong = Counter(d.outcome.why[:120] for d in done if d.kind == "wrong")
    passed = (totals["wrong"] == totals["hung"] == totals["tokens_wrong"] == totals["lost"] == 0
              and totals["not_recovered"] == 0 and totals["checks_failed"] == 0 and all(b["within"] for b in bounds))
    series = [s for s in samples if int(s["t"]) % 60 < SAMPLE_S]  # about one a minute per service
    return {"seconds": round(end - t0, 1), "window_s": window_s, "totals": totals, "windows": windows,
            "bounds": bounds, "faults": [f.__dict__ | {"at_s": round(f.at - t0, 1), "until": None} for f in faults],
            "wrong": dict(wrong.most_common(10)), "rss_series": series, "passed": passed}


def format_soak(rep: dict[str, Any]) -> str:
    t = rep["totals"]
    lines = [f"soak: {rep['seconds']:.0f} s, {t['requests']} requests: {t['ok']} ok, {t['clean']} failed cleanly "
             f"(during faults), {t['wrong']} wrong, {t['hung']} hung, {t['tokens_wrong']} wrong tokens; "
             f"{t['faults']} faults, {t['not_recovered']} not recovered, {t['lost']} persisted records lost, "
             f"{t['checks_failed']} checks failed",
             f"{'window':>12} {'req':>5} {'ok':>5} {'clean':>5} {'wrong':>5} {'hung':>4} {'TTFT p50/p99 ms':>17} "
             f"{'ITL p50/p99 ms':>16}  peak RSS MiB / fds / threads per service"]
    for w in rep["windows"]:
        res = "  ".join(f"{n}={v['rss_mib_peak']:.0f}/{v['fds_peak']}/{v['threads_peak']}"
                        for n, v in w["services"].items())
        lines.append(f"{w['from_s']:>5}-{w['to_s']:<5} s {w['requests']:>5} {w['ok']:>5} {w['clean']:>5} "
                     f"{w['wrong']:>5} {w['hung']:>4} {w['ttft_ms_p50']!s:>8}/{w['ttft_ms_p99']!s:<8} "
                     f"{w['itl_ms_p50']!s:>7}/{w['itl_ms_p99']!s:<8}  {res}")
        if w["errors"]:
            lines.append("      errors: " + "; ".join(f"{k}: {v}" for k, v in w["errors"].items()))
    lines.append("bounds, outside faults (peak after the first window vs 1.25 x first + 32 MiB RSS, +32 fds, "
                 "+16 threads):")
    for b in rep["bounds"]:
        unit = 2**20 if b["what"] == "rss_bytes" else 1
        lines.append(f"  {b['service']:<13} {b['what']:<9} first {b['first_window_peak'] / unit:8.1f}  later "
                     f"{b['later_peak'] / unit:8.1f}  bound {b['bound'] / unit:8.1f}  "
                     f"{'ok' if b['within'] else 'EXCEEDED'}")
    for f in rep["faults"]:
        rec = "never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s"
        lines.append(f"  fault at {f['at_s']:7.0f} s  {f['name']:<28} recovery {rec:>8}  lost {len(f['lost'])}"
                     + "".join(f"  check failed: {c['check']}" for c in f["checks"] if not c["passed"]))
    lines.append("PASSED" if rep["passed"] else "FAILED")
    return "\n".join(lines)
