"""The fault matrix: each fault's injection, restoration and expected behaviour.

A fault is injected while the workload runs (or, `before=True`, before it starts: faults of
start-up), lasts `hold_s`, then is restored (a service restarted, a file put back). `allowed`
is what a request may fail with while it lasts: HTTP statuses with the error envelope, and
"transport" (a connection refused or cut: the gateway itself is gone). After restoration every
request must succeed again. `checks` are the fault's own assertions (members re-registered,
gateway memory bounded, the cluster let go of every cancelled request...).

docs/reliability.md holds the same table (`FAULTS`: name, what the user sees, what is kept and
lost); tests/test_chaos.py keeps the two in step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from moetier.chaos.cluster import ChaosCluster, proc_stats
from moetier.chaos.workload import MODEL
from moetier.launch import SERVICES
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc, router_pb2, router_pb2_grpc
from moetier.weights.index import ExpertIndex

SLOW_READ_S = 0.05  # the slow disk: added to every expert read
CLOCK_JUMP_S = 30.0  # the clock jumps: 10 x the member expiry of the harness's cluster
SLOW_READERS = 8
SLOW_READER_RSS_BOUND = 64 << 20  # gateway RSS growth allowed while slow readers hold streams
CANCEL_BURST = 1000
FLOOD = 300
FLOOD_RSS_BOUND = 128 << 20  # gateway + router RSS growth allowed during the flood
REREGISTER_S = 10.0  # a member registers again within its backoff (2 s) and a few heartbeats of the router's return


@dataclass
class Ctx:
    cluster: ChaosCluster
    state: dict[str, Any] = field(default_factory=dict)
    damaged: set[str] = field(default_factory=set)  # persisted files the fault destroyed on purpose
    checks: list[tuple[str, bool, str]] = field(default_factory=list)  # (what, passed, detail)
    notes: list[str] = field(default_factory=list)
    background: list[asyncio.Task[Any]] = field(default_factory=list)
    extra_outcomes: list[Any] = field(default_factory=list)  # the fault's own requests (burst, flood)
    allowed: frozenset[int | str] = frozenset()  # what the case's requests may fail with (a pair: both's)
    alone: bool = True  # the fault is not one of a pair

    def check(self, what: str, passed: bool, detail: str = "") -> None:
        self.checks.append((what, passed, detail))


Step = Callable[[Ctx], Awaitable[None]]


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the fault, in words
    user_sees: str  # what a client sees while it lasts and after
    kept: str  # what is kept and what is lost
    inject: Step
    restore: Step | None = None
    allowed: frozenset[int | str] = frozenset()
    before: bool = False
    hold_s: float = 0.0
    needs: Callable[[ChaosCluster], str | None] = lambda c: None  # a reason to skip, or None
    check: Step | None = None  # after recovery


async def _thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ---- processes ---------------------------------------------------------------------------

def _members(c: ChaosCluster) -> dict[str, str]:
    with grpc.insecure_channel(c.address("router")) as ch:
        r = router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)
    return {m.member_id: m.address for m in r.members}


def worker_load(c: ChaosCluster) -> Any:
    with grpc.insecure_channel(c.address("dense_worker")) as ch:
        return dense_worker_pb2_grpc.DenseWorkerStub(ch).Load(dense_worker_pb2.LoadRequest(), timeout=5)


def _stop(service: str, sig: signal.Signals) -> Step:
    async def run(ctx: Ctx) -> None:
        if service == "router":
            ctx.state["member_pids"] = {s: ctx.cluster.pid(s) for s in ("dense_worker", "expert_store")}
        ctx.cluster.signal(service, sig)
        code = await _thread(ctx.cluster.wait_exit, service, 30.0)
        ctx.notes.append(f"{service} exited with {code}")
    return run


def _start(service: str) -> Step:
    async def run(ctx: Ctx) -> None:
        await _thread(ctx.cluster.start, service)
    return run


def _then(*steps: Step) -> Step:
    async def run(ctx: Ctx) -> None:
        for s in steps:
            await s(ctx)
    return run


async def _members_stayed(ctx: Ctx) -> None:
    """After a router restart: the worker and the store kept running and registered again."""
    pids = ctx.state.get("member_pids", {})
    same = all(ctx.cluster.pid(s) == p and ctx.cluster.alive(s) for s, p in pids.items())
    want = {ctx.cluster.settings.dense_worker.id, ctx.cluster.settings.expert_store.id}
    # requests are served again once the worker is back: the store may take a heartbeat longer
    t0 = time.monotonic()
    while not want <= set(members := await _thread(_members, ctx.cluster)) and time.monotonic() - t0 < REREGISTER_S:
        await asyncio.sleep(0.25)
    ctx.check("worker and store kept running and re-registered", same and want <= set(members),
              f"members {sorted(members)} {time.monotonic() - t0:.1f} s after the requests were served again")


PROCESS_ALLOWED: dict[str, frozenset[int | str]] = {
    "router": frozenset({503}),
    "expert_store": frozenset({503}),
    "dense_worker": frozenset({503}),
    "gateway": frozenset({"transport", 503}),
}
SEES = {
    "router": "requests in flight end with 503 (an error event mid-stream); new ones 503 until it is back",
    "expert_store": "requests in flight end with 503 (an error event mid-stream); new ones 503 until it is back",
    "dense_worker": "requests in flight end with 503 (an error event mid-stream); new ones 503 until it is back",
    "gateway": "connections refused or cut (SIGTERM: streams drained first) until it is back",
}
KEPT = {
    "router": "everything persisted; the queue's requests fail (the queue is memory)",
    "expert_store": "everything persisted; usage counts since the last save (SIGKILL; SIGTERM saves)",
    "dense_worker": "everything persisted; prefix-cache entries not yet written (SIGKILL)",
    "gateway": "everything persisted",
}


def process_faults() -> list[Fault]:
    out = []
    for service in SERVICES:
        for sig, signame in ((signal.SIGKILL, "kill"), (signal.SIGTERM, "term")):
            check = _members_stayed if service == "router" else None
            out.append(Fault(
                f"{signame}-{service}-restart", f"{sig.name} of the {service} mid-stream, restarted at once",
                SEES[service] + ("; the worker and store re-register" if service == "router" else ""),
                KEPT[service], _then(_stop(service, sig), _start(service)), allowed=PROCESS_ALLOWED[service],
                check=check))
            out.append(Fault(
                f"{signame}-{service}-down", f"{sig.name} of the {service} mid-stream, left down 5 s, then started",
                SEES[service] + "; while it is down every request fails at once (none hangs)",
                KEPT[service], _stop(service, sig), _start(service), allowed=PROCESS_ALLOWED[service],
                hold_s=5.0, check=check))
    return out


# ---- disks -------------------------------------------------------------------------------

def _index(c: ChaosCluster) -> ExpertIndex:
    return ExpertIndex.load(c.model_dir / "experts")


def _flip(root: Path, keys: list[tuple[int, int]], ctx: Ctx, tag: str) -> None:
    """Flip one byte in the middle of each record (in place: the store's open files see it)."""
    index = _index(ctx.cluster)
    saved = ctx.state.setdefault("flipped", [])
    for key in keys:
        loc = index.location(key)
        path = root / loc.path
        at = loc.offset + loc.length // 2
        with open(path, "r+b") as f:
            f.seek(at)
            old = f.read(1)
            f.seek(at)
            f.write(bytes([old[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        saved.append((path, at, old))
    ctx.notes.append(f"{len(keys)} record(s) corrupted on the {tag}")


async def _unflip(ctx: Ctx) -> None:
    for path, at, old in reversed(ctx.state.pop("flipped", [])):
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(old)
            f.flush()
            os.fsync(f.fileno())


def _all_keys(ctx: Ctx) -> list[tuple[int, int]]:
    return sorted(k for k, _ in _index(ctx.cluster))


async def _corrupt_primary(ctx: Ctx) -> None:
    _flip(ctx.cluster.model_dir / "experts", _all_keys(ctx), ctx, "primary")


async def _corrupt_mirror(ctx: Ctx) -> None:
    _flip(ctx.cluster.mirror, _all_keys(ctx), ctx, "mirror")


async def _corrupt_both(ctx: Ctx) -> None:
    keys = _all_keys(ctx)[::8]
    _flip(ctx.cluster.model_dir / "experts", keys, ctx, "primary")
    _flip(ctx.cluster.mirror, keys, ctx, "mirror")


async def _remove_mirror(ctx: Ctx) -> None:
    shutil.rmtree(ctx.cluster.mirror)


async def _restore_mirror(ctx: Ctx) -> None:
    if ctx.cluster.mirror.exists():
        for p in [ctx.cluster.mirror, *ctx.cluster.mirror.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    else:
        shutil.copytree(ctx.cluster.model_dir / "experts", ctx.cluster.mirror)


async def _unreadable_mirror(ctx: Ctx) -> None:
    for p in [*ctx.cluster.mirror.iterdir(), ctx.cluster.mirror]:
        p.chmod(0)
    # The store holds the mirror's files open (reads keep working, as they do on Linux): the
    # permission bites when they are opened, at its start.
    await _then(_stop("expert_store", signal.SIGTERM), _start("expert_store"))(ctx)


def _unreadable_needs(c: ChaosCluster) -> str | None:
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        return "running as root without setpriv: the store would read a chmod-000 mirror anyway"
    return None


async def _slow(ctx: Ctx) -> None:
    ctx.cluster.read_delay_file.write_text(f"{SLOW_READ_S}\n")


async def _fast(ctx: Ctx) -> None:
    ctx.cluster.read_delay_file.write_text("0\n")


def _fill(path: Path) -> int:
    """Fill the filesystem of `path` with one file; the bytes written."""
    n = 0
    chunk = b"\0" * (256 << 10)
    with open(path, "wb") as f:
        while True:
            try:
                f.write(chunk)
                f.flush()
                n += len(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return n


async def _disk_full(ctx: Ctx) -> None:
    n = _fill(ctx.cluster.volatile / "filler")
    ctx.notes.append(f"volatile tmpfs filled ({n >> 20} MiB)")


def _log_count(c: ChaosCluster, service: str, text: str) -> int:
    try:
        return (c.settings.data_path / "logs" / f"{service}.log").read_text(errors="replace").count(text)
    except OSError:
        return 0


async def _disk_full_prefix(ctx: Ctx) -> None:
    """Full, then prompts the cache has never seen: their entries must be written (and fail)."""
    c = ctx.cluster
    failed0 = _log_count(c, "dense_worker", "prefix cache: writing")
    await _disk_full(ctx)
    async with httpx.AsyncClient(base_url=c.url, timeout=120) as client:
        for i in range(4):
            body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "user", "content": f"A prompt never seen before: {time.time_ns()} {i}"}]}
            try:
                r = await client.post("/v1/chat/completions", json=body)
                ctx.extra_outcomes.append("ok" if r.status_code == 200 else "clean" if r.status_code in ctx.allowed
                                          and "error" in r.json() else f"wrong: disk full: {r.status_code}")
            except httpx.HTTPError as e:
                ctx.extra_outcomes.append("clean" if "transport" in ctx.allowed else
                                          f"wrong: disk full: {type(e).__name__}")
    deadline = time.monotonic() + 10
    while _log_count(c, "dense_worker", "prefix cache: writing") == failed0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the writes run on the cache's own thread
    failed = _log_count(c, "dense_worker", "prefix cache: writing") - failed0
    if ctx.alone:  # in a pair the worker may be down: its writes are not attempted
        ctx.check("prefix-cache writes met the full disk (failed, logged) and the requests succeeded",
                  failed > 0, f"{failed} failed writes logged")


async def _disk_full_history(ctx: Ctx) -> None:
    await _disk_full(ctx)
    # the usage history is saved every 30 s and at a clean stop: stop the store now, while full
    await _then(_stop("expert_store", signal.SIGTERM), _start("expert_store"))(ctx)


async def _disk_free(ctx: Ctx) -> None:
    (ctx.cluster.volatile / "filler").unlink(missing_ok=True)


def _tmpfs_needs(c: ChaosCluster) -> str | None:
    return None if c.tmpfs else "no tmpfs for the data directory (needs root and mount): cannot fill a disk"


async def _torn_prefix(ctx: Ctx) -> None:
    await _stop("dense_worker", signal.SIGKILL)(ctx)
    files = sorted(ctx.cluster.prefix_dir.glob("*.kv"))
    if len(files) >= 1:
        torn = files[0]
        with open(torn, "r+b") as f:
            f.truncate(max(1, torn.stat().st_size // 2))
        ctx.damaged.add(torn.name)
    if len(files) >= 2:
        bad = files[1]
        with open(bad, "r+b") as f:
            f.seek(-8, os.SEEK_END)
            last = f.read(1)
            f.seek(-8, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x5A]))
        ctx.damaged.add(bad.name)
    (ctx.cluster.prefix_dir / "garbage.kv").write_bytes(b"MTPFXKV1" + os.urandom(100))
    ctx.notes.append(f"{min(len(files), 2)} prefix-cache file(s) torn/corrupted, one garbage file added")
    await _start("dense_worker")(ctx)


async def _torn_prefix_check(ctx: Ctx) -> None:
    left = (ctx.cluster.prefix_dir / "garbage.kv").exists()
    ctx.check("the garbage prefix-cache file was rejected and removed", not left)


async def _torn_history(ctx: Ctx) -> None:
    await _stop("expert_store", signal.SIGKILL)(ctx)
    h = ctx.cluster.history_path
    if h.exists():
        with open(h, "r+b") as f:
            f.truncate(max(1, h.stat().st_size // 2))
    else:
        h.write_bytes(b"MTHIST01" + os.urandom(64))
    ctx.damaged.add("history")
    await _start("expert_store")(ctx)


# ---- clocks ------------------------------------------------------------------------------

def _jump(seconds: float) -> Step:
    async def run(ctx: Ctx) -> None:
        ctx.cluster.clock_offset_file.write_text(f"{seconds}\n")
    return run


async def _members_present(ctx: Ctx) -> None:
    members = await _thread(_members, ctx.cluster)
    want = {ctx.cluster.settings.dense_worker.id, ctx.cluster.settings.expert_store.id}
    ctx.check("worker and store registered after the jumps", want <= set(members), f"members {sorted(members)}")


# ---- clients -----------------------------------------------------------------------------

def _raw_request(c: ChaosCluster, body: bytes, path: str = "/v1/chat/completions") -> bytes:
    host, port = c.settings.gateway.bind.rsplit(":", 1)
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def _open(c: ChaosCluster, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = c.settings.gateway.bind.rsplit(":", 1)
    if rcvbuf is None:
        return await asyncio.open_connection(host, int(port))
    import socket

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
    return await asyncio.open_connection(sock=s)


def _body(i: int, max_tokens: int, stream: bool) -> bytes:
    import json

    return json.dumps({"model": MODEL, "stream": stream, "max_tokens": max_tokens, "temperature": 0.8,
                       "seed": i, "messages": [{"role": "user", "content": f"Request {i}: a long story."}]}).encode()


async def _slow_readers(ctx: Ctx) -> None:
    c = ctx.cluster
    # The gateway holding the readers: a gateway restarted meanwhile (a pair) holds none of them,
    # and its RSS grows from its start-up, which is not what is measured here.
    pid = c.pid("gateway")
    first: dict[int, int] = {}
    peak: dict[int, int] = {}

    def sample() -> None:
        if (st := proc_stats(pid)) is not None:
            first.setdefault(pid, st["rss_bytes"])
            peak[pid] = max(peak.get(pid, 0), st["rss_bytes"])

    sample()
    conns = []
    for i in range(SLOW_READERS):
        try:
            r, w = await _open(c, rcvbuf=4096)
        except OSError:
            if "transport" not in ctx.allowed:
                raise
            continue
        w.write(_raw_request(c, _body(i, 400, True)))
        await w.drain()
        conns.append((r, w))
    t_end = time.monotonic() + 8.0
    while time.monotonic() < t_end:  # read nothing for 8 s, then a byte
        await asyncio.sleep(0.5)
        sample()
    for r, _ in conns:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(r.read(1), 1.0)
    for _, w in conns:
        w.close()
    growth = max((peak[p] - first[p] for p in peak), default=0)
    ctx.check(f"gateway RSS growth with {SLOW_READERS} readers that do not read < {SLOW_READER_RSS_BOUND >> 20} MiB",
              growth < SLOW_READER_RSS_BOUND, f"{growth / 2**20:.1f} MiB")
    await settled(ctx)


async def settled(ctx: Ctx, within_s: float = 60.0) -> None:
    """Every request let go: worker, router queue and gateway hold nothing (the KV back to its
    baseline)."""
    c = ctx.cluster
    base = ctx.state.get("kv_baseline")
    state = ""
    deadline = time.monotonic() + within_s
    while True:
        try:
            load = await _thread(worker_load, c)
            async with httpx.AsyncClient(timeout=5) as client:
                r = _parse((await client.get(c.metrics_url("router"))).text)
                g = _parse((await client.get(c.metrics_url("gateway"))).text)
            state = (f"worker running={load.running} waiting={load.waiting} kv_bytes={load.kv_bytes} "
                     f"(baseline {base}); router queue={r.get('moetier_router_queue_depth')} in_flight="
                     f"{r.get('moetier_router_in_flight')}; gateway running="
                     f"{g.get('moetier_gateway_running_requests')}")
            if (load.running == 0 and load.waiting == 0 and (base is None or load.kv_bytes == base)
                    and r.get("moetier_router_queue_depth") == 0 and r.get("moetier_router_in_flight") == 0
                    and g.get("moetier_gateway_running_requests") == 0):
                ctx.check("the cluster let go of every request", True, state)
                return
        except (grpc.RpcError, httpx.HTTPError) as e:
            state = f"not answering: {e}"
        if time.monotonic() > deadline:
            ctx.check("the cluster let go of every request", False, f"after {within_s:.0f} s: {state}")
            return
        await asyncio.sleep(0.5)


def _parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


async def _burst_one(ctx: Ctx, i: int, delay_s: float, results: list[str]) -> None:
    try:
        r, w = await _open(ctx.cluster)
    except OSError as e:
        results.append("clean" if "transport" in ctx.allowed else f"wrong: connect {e}")
        return
    try:
        w.write(_raw_request(ctx.cluster, _body(i, 200, True)))
        await w.drain()
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), delay_s)
        except (TimeoutError, asyncio.IncompleteReadError):
            results.append("clean")  # cancelled before the answer started
            return
        status_line, *headers = head.decode(errors="replace").split("\r\n")
        status = int(status_line.split()[1])
        hdrs = {h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip() for h in headers if ":" in h}
        if status == 200 or (status == 429 and hdrs.get("retry-after", "").isdigit()) or status in ctx.allowed:
            results.append("clean")
        else:
            results.append(f"wrong: status {status}")
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(r.read(256), max(0.0, delay_s / 2))
    finally:
        w.close()


async def _cancel_burst(ctx: Ctx) -> None:
    rng = random.Random(17)
    results: list[str] = []
    sem = asyncio.Semaphore(500)  # fds: two per connection in this process and the gateway

    async def one(i: int) -> None:
        async with sem:
            await _burst_one(ctx, i, rng.uniform(0.05, 1.0), results)

    await asyncio.gather(*(one(i) for i in range(CANCEL_BURST)))
    ctx.extra_outcomes.extend(results)
    wrong = [r for r in results if r != "clean"]
    ctx.notes.append(f"{CANCEL_BURST} streams opened and abandoned; {len(wrong)} answered wrongly")
    await settled(ctx)


async def _flood(ctx: Ctx) -> None:
    c = ctx.cluster
    # The processes the flood meets: one restarted meanwhile (a pair) grows from its start-up,
    # which is not what is measured here.
    pids = [c.pid(svc) for svc in ("gateway", "router")]
    first: dict[int, int] = {}
    peak: dict[int, int] = {}

    def sample() -> None:
        for pid in pids:
            if (st := proc_stats(pid)) is not None:
                first.setdefault(pid, st["rss_bytes"])
                peak[pid] = max(peak.get(pid, 0), st["rss_bytes"])

    sample()
    results: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=c.url, limits=limits, timeout=120) as client:
        async def one(i: int) -> None:
            try:
                r = await client.post("/v1/chat/completions", content=_body(i, 8, False),
                                      headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                results.append("clean" if "transport" in ctx.allowed else f"wrong: {type(e).__name__}")
                return
            if r.status_code == 200:
                results.append("ok")
            elif ((r.status_code == 429 and r.headers.get("retry-after", "").isdigit()) or r.status_code in ctx.allowed) \
                    and "error" in r.json():
                results.append("clean")
            else:
                results.append(f"wrong: status {r.status_code}")

        async def watch() -> None:
            while True:
                sample()
                await asyncio.sleep(0.25)

        w = asyncio.ensure_future(watch())
        await asyncio.gather(*(one(i) for i in range(FLOOD)))
        w.cancel()
    ctx.extra_outcomes.extend(results)
    n429 = sum(r == "clean" for r in results)
    growth = sum(peak[p] - first[p] for p in peak)
    ctx.notes.append(f"flood of {FLOOD}: {results.count('ok')} answered, {n429} refused (429, or as the pair allows)")
    ctx.check(f"gateway + router RSS growth during the flood < {FLOOD_RSS_BOUND >> 20} MiB",
              growth < FLOOD_RSS_BOUND, f"{growth / 2**20:.1f} MiB")
    if ctx.alone:
        ctx.check("the flood met the queue (some 429)", n429 > 0, f"{n429} of {FLOOD}")
    await settled(ctx)


# ---- the matrix --------------------------------------------------------------------------

def all_faults() -> list[Fault]:
    return [
        *process_faults(),
        Fault("mirror-removed", "the mirror directory deleted (rm -rf) mid-stream, then copied back",
              "nothing: reads go to the primary", "everything", _remove_mirror, _restore_mirror, hold_s=3.0),
        Fault("mirror-unreadable", "the mirror's files made unreadable (chmod 000) and the store restarted",
              "nothing: the store starts with the mirror degraded and reads the primary",
              "everything", _unreadable_mirror, _restore_mirror, before=True, needs=_unreadable_needs),
        Fault("corrupt-primary", "every expert record on the primary corrupted (one byte flipped) mid-stream",
              "nothing: each record fails its checksum and is read from the mirror", "everything",
              _corrupt_primary, _unflip, hold_s=3.0),
        Fault("corrupt-mirror", "every expert record on the mirror corrupted mid-stream",
              "nothing: each record fails its checksum and is read from the primary", "everything",
              _corrupt_mirror, _unflip, hold_s=3.0),
        Fault("corrupt-both", "one record in eight corrupted on the primary and on the mirror",
              "a request that needs one (not in RAM) fails with 500 naming the record; never wrong math",
              "everything", _corrupt_both, _unflip, allowed=frozenset({500}), hold_s=3.0),
        Fault("slow-disk", f"every expert read delayed {SLOW_READ_S * 1000:.0f} ms (the I/O engine's test hook)",
              "slower answers, nothing fails", "everything", _slow, _fast, hold_s=5.0),
        Fault("disk-full-prefix-cache", "the prefix cache's filesystem full while entries are written",
              "nothing (writes fail, logged, counted); the cache keeps serving from memory",
              "the files written before; new entries are not persisted while full", _disk_full_prefix, _disk_free,
              hold_s=3.0, needs=_tmpfs_needs),
        Fault("disk-full-history", "the usage history's filesystem full when the store saves it (clean stop)",
              "503 while the store restarts, nothing else", "the last saved history (the new save fails)",
              _disk_full_history, _disk_free, allowed=frozenset({503}), needs=_tmpfs_needs),
        Fault("torn-prefix-cache", "prefix-cache files torn, corrupted and garbage at the worker's start",
              "nothing: the bad files are rejected (logged, removed), their prompts prefilled again",
              "every valid file; the damaged ones are lost by the fault itself", _torn_prefix, before=True,
              check=_torn_prefix_check),
        Fault("torn-history", "the usage-history file torn at the store's start",
              "nothing: the history is ignored (logged) and rebuilt", "the prefix cache; the damaged history",
              _torn_history, before=True),
        Fault("clock-jump-forward", f"the router's heartbeat clock jumps {CLOCK_JUMP_S:.0f} s forward, then back",
              "members look silent and are dropped, then re-register: requests in the gap may get 503",
              "everything", _jump(CLOCK_JUMP_S), _jump(0.0), allowed=frozenset({503}), hold_s=3.0,
              check=_members_present),
        Fault("clock-jump-backward", f"the router's heartbeat clock jumps {CLOCK_JUMP_S:.0f} s back, then forward",
              "nothing going back; going forward again as clock-jump-forward", "everything",
              _jump(-CLOCK_JUMP_S), _jump(0.0), allowed=frozenset({503}), hold_s=3.0, check=_members_present),
        Fault("slow-reader", f"{SLOW_READERS} streaming clients that stop reading (4 KiB receive buffers) for 8 s",
              f"nothing for the others; the gateway's memory stays bounded (< {SLOW_READER_RSS_BOUND >> 20} MiB "
              "growth); the abandoned streams are cancelled", "everything", _slow_readers),
        Fault("cancel-burst", f"{CANCEL_BURST} streams opened at once and abandoned within 1 s",
              "the others may get 429 (with Retry-After) while the queue is full; every abandoned request is "
              "cancelled down the chain and its KV freed", "everything", _cancel_burst,
              allowed=frozenset({429})),
        Fault("flood", f"{FLOOD} requests at once, past the queue",
              f"429 with Retry-After past the queue, never a 5xx; RSS bounded (< {FLOOD_RSS_BOUND >> 20} MiB growth)",
              "everything", _flood, allowed=frozenset({429})),
    ]


FAULTS: dict[str, Fault] = {f.name: f for f in all_faults()}

# Pairs injected together (each one's allowed failures, both restored).
PAIRS: list[tuple[str, str]] = [
    ("kill-expert_store-restart", "corrupt-primary"),
    ("mirror-removed", "slow-disk"),
    ("kill-dense_worker-restart", "cancel-burst"),
    ("kill-router-restart", "flood"),
    ("corrupt-mirror", "term-expert_store-restart"),
    ("clock-jump-forward", "kill-router-restart"),
    ("slow-reader", "kill-gateway-restart"),
    ("disk-full-prefix-cache", "kill-dense_worker-restart"),
]

SHORT = ["kill-expert_store-restart", "term-dense_worker-restart", "kill-router-restart", "kill-gateway-down",
         "mirror-removed", "corrupt-primary", "corrupt-both", "slow-disk", "torn-prefix-cache", "clock-jump-forward",
         "cancel-burst", "flood"]
SHORT_PAIRS: list[tuple[str, str]] = [("kill-expert_store-restart", "corrupt-primary")]


def _allowed_text(f: Fault) -> str:
    parts = [str(a) for a in sorted(a for a in f.allowed if isinstance(a, int))]
    if "transport" in f.allowed:
        parts.append("connection refused/cut")
    return ", ".join(parts) or "none"


def fault_table() -> str:
    """The matrix as docs/reliability.md shows it (tests/test_chaos.py keeps the two equal)."""
    lines = ["| fault | what the harness does | what the user sees | failures allowed while it lasts | "
             "what is kept, what is lost |", "|---|---|---|---|---|"]
    for f in FAULTS.values():
        when = " (at start-up, before the load)" if f.before else ""
        lines.append(f"| `{f.name}` | {f.what}{when} | {f.user_sees} | {_allowed_text(f)} | {f.kept} |")
    return "\n".join(lines)
