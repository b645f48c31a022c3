"""`moetier bench cancel`: what a storm of abandoned streams costs the next request.

The figures tests/test_up.py::test_200_abandoned_streams_leave_no_live_sequence used to time
(that test now asserts only what must hold on any machine): on a cluster of the demo model
(moetier up's services, `moetier.chaos.cluster`), one short greedy request's latency on the idle
cluster (the peer, `--repeat` times, median), then `--streams` streaming clients that give up
(read timeouts before the first byte, deadlines mid-stream), then:

  * settle: from the last client giving up until the cluster holds nothing (worker running and
    waiting 0, its KV back to the baseline, router queue and in-flight 0, gateway running 0);
  * the same short request right after settling (`--repeat` times, median), beside the idle figure.

Machine load is printed with the figures (loadavg, and the CPUs this process may use): on a
shared machine the difference between idle and after is partly what others took."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from moetier.chaos.cluster import ChaosCluster
from moetier.chaos.faults import Ctx, settled, worker_load
from moetier.chaos.workload import MODEL


async def _fresh(url: str, n: int) -> list[float]:
    out = []
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Still there?"}]}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for _ in range(n):
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(time.monotonic() - t0)
    return out


async def impatient(url: str, n: int, headers: dict[str, str] | None = None) -> dict[str, int]:
    """n concurrent streams, each abandoned by its client: some while queued (a read timeout before
    the first byte), most mid-stream (an overall deadline)."""
    outcomes: dict[str, int] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers) as client:
        async def one(i: int) -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": 300, "temperature": 0.8, "seed": i,
                    "messages": [{"role": "user", "content": f"Request {i}: tell me a long story."}]}
            outcome = "completed"
            try:
                async with asyncio.timeout(0.5 + (i % 8) * 0.5):
                    async with client.stream("POST", "/v1/chat/completions", json=body,
                                             timeout=httpx.Timeout(30, read=0.3 + (i % 5) * 0.4)) as r:
                        if r.status_code != 200:
                            outcome = f"status {r.status_code}"
                        async for _ in r.aiter_lines():
                            pass
            except httpx.ReadTimeout:
                outcome = "read timeout"
            except TimeoutError:
                outcome = "deadline"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


async def measure(root: Path, streams: int, repeat: int) -> dict[str, Any]:
    cluster = ChaosCluster(root)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, cluster.prepare)
        await loop.run_in_executor(None, cluster.start_all)
        await _fresh(cluster.url, 2)  # warm: kernels, first prefill, the prefix cache
        idle = await _fresh(cluster.url, repeat)
        ctx = Ctx(cluster)
        ctx.state["kv_baseline"] = (await loop.run_in_executor(None, worker_load, cluster)).kv_bytes
        load0 = os.getloadavg()
        t0 = time.monotonic()
        outcomes = await impatient(cluster.url, streams)
        t_gone = time.monotonic()
        await settled(ctx, within_s=600)
        t_settled = time.monotonic()
        after = await _fresh(cluster.url, repeat)
        ok = all(p for _, p, _ in ctx.checks)
    finally:
        await loop.run_in_executor(None, cluster.close)
    return {"streams": streams, "outcomes": outcomes, "storm_s": round(t_gone - t0, 2),
            "settle_s": round(t_settled - t_gone, 2), "settled": ok,
            "fresh_idle_s": round(statistics.median(idle), 3), "fresh_after_s": round(statistics.median(after), 3),
            "fresh_idle_all": [round(x, 3) for x in idle], "fresh_after_all": [round(x, 3) for x in after],
            "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": len(os.sched_getaffinity(0))}


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    root = args.dir or Path(tempfile.mkdtemp(prefix="moetier-bench-cancel-"))
    rep = asyncio.run(measure(root, args.streams, args.repeat))
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(f"{rep['streams']} abandoned streams ({rep['outcomes']}) over {rep['storm_s']:.1f} s; the cluster "
              f"{'let go of every request' if rep['settled'] else 'DID NOT let go of every request'} "
              f"{rep['settle_s']:.2f} s after the last client left")
        print(f"fresh 8-token request: {rep['fresh_after_s'] * 1000:.0f} ms after the storm beside "
              f"{rep['fresh_idle_s'] * 1000:.0f} ms on the idle cluster (medians of {args.repeat}; "
              f"{rep['cpus']} CPUs, loadavg {rep['loadavg_before'][0]:.2f} -> {rep['loadavg_after'][0]:.2f})")
    return 0 if rep["settled"] else 1


def register(sub: Any) -> None:
    p = sub.add_parser("cancel", help="a storm of abandoned streams: how long the cluster takes to let go, and "
                       "the next request's latency beside the idle cluster's")
    p.add_argument("--streams", type=int, default=200, help="abandoned streams (default 200)")
    p.add_argument("--repeat", type=int, default=5, help="fresh requests per measurement (default 5)")
    p.add_argument("--dir", type=Path, help="run directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)
