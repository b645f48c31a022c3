"""The chaos harness: a reference run, then each fault (and each pair) under the workload, every
outcome checked; the report. `moetier chaos` (moetier/commands/chaos.py) is its command line,
docs/reliability.md describes the matrix and the figures.

One case, for a fault or a pair:
1. the cluster healthy (any service still down from the last case started), nothing running;
   what is persisted read (prefix-cache entries, usage-history total);
2. the workload's first part (`during`) sent at a steady pace; after 1 s the fault is injected
   (a start-up fault: before the first request), held `hold_s`, restored;
3. from the injection, a probe (a 1-token request every 0.25 s) measures the recovery time: from
   the injection to the first answered probe after the last failed one (0: none failed);
4. once recovered, the second part (`after`) must succeed entirely, tokens equal to the reference;
5. the fault's own checks; what is persisted read again: anything that was there before and is
   not now (less what the fault damaged on purpose) is lost.
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from moetier.chaos.cluster import ChaosCluster
from moetier.chaos.faults import FAULTS, PAIRS, SHORT, SHORT_PAIRS, Ctx, Fault, worker_load
from moetier.chaos.persist import Persisted
from moetier.chaos.workload import MODEL, Outcome, Spec, check_tokens, run_one, workload

PACE_S = 0.25  # between the starts of the workload's requests
CONCURRENCY = 6
DEADLINE_S = 120.0  # a request not answered by then hung
RECOVERY_LIMIT_S = 120.0
INJECT_AFTER_S = 1.0


@dataclass
class Plan:
    during: int = 24
    after: int = 8

    @classmethod
    def short(cls) -> Plan:
        return cls(during=10, after=4)


@dataclass
class Row:
    fault: str
    tried: int = 0
    succeeded: int = 0
    failed_clean: int = 0
    failed_wrong: int = 0
    hung: int = 0
    tokens_wrong: int = 0
    recovery_s: float | None = None
    lost: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # what went wrong, for wrong / hung / tokens
    skipped: str | None = None
    seconds: float = 0.0
    persisted: int = 0  # prefix-cache entries (+ 1 for a usage history) on disk before the fault

    @property
    def bad(self) -> bool:
        return bool(self.failed_wrong or self.hung or self.tokens_wrong or self.lost or (self.recovery_s is None
                    and self.skipped is None) or any(not c["passed"] for c in self.checks))

    def add(self, specs: list[Spec], outcomes: list[Outcome], phase: str) -> None:
        for s, o in zip(specs, outcomes, strict=True):
            self.tried += 1
            if o.kind == "ok":
                self.succeeded += 1
            elif o.kind == "clean":
                self.failed_clean += 1
            elif o.kind == "hung":
                self.hung += 1
            else:
                self.failed_wrong += 1
            if o.kind in ("wrong", "hung"):
                self.failures.append(f"{phase} #{s.index} ({'stream' if s.stream else 'plain'}): {o.why}")
            if o.tokens_wrong:
                self.tokens_wrong += 1
                self.failures.append(f"{phase} #{s.index}: tokens differ from the reference: {o.text[:80]!r}")

    def add_extra(self, results: list[str]) -> None:
        for r in results:
            self.tried += 1
            if r == "ok":
                self.succeeded += 1
            elif r == "clean":
                self.failed_clean += 1
            else:
                self.failed_wrong += 1
                if len(self.failures) < 20:
                    self.failures.append(r)


async def run_workload(url: str, specs: list[Spec], allowed: frozenset[int | str],
                       pace_s: float = PACE_S, concurrency: int = CONCURRENCY) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(DEADLINE_S), limits=limits) as client:
        async def one(k: int, s: Spec) -> Outcome:
            await asyncio.sleep(k * pace_s)
            async with sem:
                return await run_one(client, s, allowed, DEADLINE_S)

        return list(await asyncio.gather(*(one(k, s) for k, s in enumerate(specs))))


@dataclass
class Probe:
    url: str
    t0: float
    results: list[tuple[float, bool]] = field(default_factory=list)
    restored_at: float | None = None
    task: asyncio.Task[None] | None = None

    async def loop(self) -> None:
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "ping"}]}
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            while True:
                try:
                    ok = (await client.post("/v1/chat/completions", json=body)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.results.append((time.monotonic(), ok))
                if self.recovered() is not None:
                    return
                await asyncio.sleep(0.25)

    def recovered(self) -> float | None:
        """Seconds from the injection to recovery once recovered (after the restoration), else None."""
        if self.restored_at is None:
            return None
        fails = [t for t, ok in self.results if not ok]
        last_fail = max(fails) if fails else None
        for t, ok in self.results:
            if ok and t >= self.restored_at and (last_fail is None or t > last_fail):
                return 0.0 if last_fail is None else t - self.t0
        return None


def _disks_ok(text: str) -> bool:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("moetier_expert_store_disk_ok{")]
    return bool(values) and all(v == 1.0 for v in values)


async def mirrors_back(cluster: ChaosCluster, within_s: float = 90.0) -> None:
    """Wait until every copy of the experts serves again. A degraded mirror is re-validated by
    the first read that considers it after the store's re-check interval (10 s): requests with
    prompts of their own make the store read (its RAM tier holds a quarter of the experts)."""
    deadline = time.monotonic() + within_s
    n = 0
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:
        while not _disks_ok((await client.get(cluster.metrics_url("expert_store"))).text):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a copy of the experts still degraded after {within_s:.0f} s")
            n += 1
            words = " ".join(str((n * 7919 + k * 104729) % 100003) for k in range(12))
            await client.post("/v1/completions", json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                                                       "prompt": f"Warm the copies {n}: {words}"})
            await asyncio.sleep(0.2)


async def healthy(cluster: ChaosCluster, idle: bool = True) -> None:
    """Every service up and the cluster serving; `idle`: and no request running on the worker."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, cluster.start_all)
    deadline = time.monotonic() + 60
    while True:  # and serving: the members registered (after a router restart, say)
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(cluster.url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ready?"}]})
                if r.status_code == 200:
                    break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster does not serve after 60 s")
        await asyncio.sleep(0.5)
    await mirrors_back(cluster)
    while idle and (await loop.run_in_executor(None, worker_load, cluster)).running:
        await asyncio.sleep(0.2)


async def reference_run(cluster: ChaosCluster, plan: Plan) -> tuple[dict[str, str], Row]:
    await healthy(cluster)
    specs = workload(plan.during + plan.after)
    row = Row("none (reference)")
    t0 = time.monotonic()
    outcomes = await run_workload(cluster.url, specs, frozenset())
    row.add(specs, outcomes, "reference")
    row.recovery_s = 0.0
    row.seconds = time.monotonic() - t0
    ref = {s.key: o.text for s, o in zip(specs, outcomes, strict=True) if s.greedy and o.kind == "ok"}
    # streamed and plain requests of one greedy body must agree with each other too
    for s, o in zip(specs, outcomes, strict=True):
        if s.greedy and o.kind == "ok" and ref.get(s.key) != o.text:
            row.tokens_wrong += 1
            row.failures.append(f"reference #{s.index}: streamed and plain texts differ")
    return ref, row


async def inject_restore(ctx: Ctx, faults: list[Fault], hold_s: float) -> None:
    """Inject, hold, restore; a step that raises (a service that does not start again, say) is a
    failed check of the case, and the restoration runs whatever happened."""
    def note(step: str, results: list[Any], which: list[Fault]) -> None:
        for f, r in zip(which, results, strict=True):
            if isinstance(r, BaseException):
                ctx.check(f"{f.name}: {step}", False, f"{type(r).__name__}: {r}")

    try:
        note("injected", await asyncio.gather(*(f.inject(ctx) for f in faults), return_exceptions=True), faults)
        await asyncio.sleep(hold_s)
    finally:
        which = [f for f in faults if f.restore is not None]
        note("restored", await asyncio.gather(*(f.restore(ctx) for f in which if f.restore is not None),
                                              return_exceptions=True), which)


async def run_case(cluster: ChaosCluster, faults: list[Fault], reference: dict[str, str], plan: Plan) -> Row:
    row = Row(" + ".join(f.name for f in faults))
    for f in faults:
        if (why := f.needs(cluster)) is not None:
            row.skipped = why
            return row
    t_start = time.monotonic()
    await healthy(cluster)
    ctx = Ctx(cluster)
    ctx.state["kv_baseline"] = (await asyncio.get_running_loop().run_in_executor(None, worker_load, cluster)).kv_bytes
    before = Persisted.read(cluster.prefix_dir, cluster.history_path)
    row.persisted = len(before.entries) + (before.history is not None)
    allowed: frozenset[int | str] = frozenset().union(*(f.allowed for f in faults))
    ctx.allowed, ctx.alone = allowed, len(faults) == 1
    during, after = workload(plan.during), workload(plan.after, plan.during)
    hold = max(f.hold_s for f in faults)

    async def inject_and_restore(probe: Probe) -> None:
        await inject_restore(ctx, faults, hold)
        probe.restored_at = time.monotonic()

    pre = [f for f in faults if f.before]
    probe = Probe(cluster.url, time.monotonic())
    if pre:
        probe.task = asyncio.ensure_future(probe.loop())
        await inject_and_restore(probe)
        # a start-up fault: the load comes once the restarted service serves (registered with the
        # router, which a healthy gRPC server may not be yet)
        await healthy(cluster, idle=False)
        work = asyncio.ensure_future(run_workload(cluster.url, during, allowed))
    else:
        work = asyncio.ensure_future(run_workload(cluster.url, during, allowed))
        await asyncio.sleep(INJECT_AFTER_S)
        probe.t0 = time.monotonic()
        probe.task = asyncio.ensure_future(probe.loop())
        await inject_and_restore(probe)
    outcomes = await work
    check_tokens(during, outcomes, reference)
    row.add(during, outcomes, "during")
    try:
        await asyncio.wait_for(asyncio.shield(probe.task), RECOVERY_LIMIT_S)
        row.recovery_s = probe.recovered()
    except TimeoutError:
        probe.task.cancel()
        row.recovery_s = None
        row.failures.append(f"no recovery within {RECOVERY_LIMIT_S:.0f} s of the restoration")
    if row.recovery_s is not None:
        outcomes = await run_workload(cluster.url, after, frozenset())
        check_tokens(after, outcomes, reference)
        row.add(after, outcomes, "after")
    row.add_extra(ctx.extra_outcomes)
    for f in faults:
        if f.check is not None:
            await f.check(ctx)
    for what, passed, detail in ctx.checks:
        row.checks.append({"check": what, "passed": passed, "detail": detail})
    await asyncio.sleep(0.5)  # the prefix cache writes in the background
    row.lost = before.lost(Persisted.read(cluster.prefix_dir, cluster.history_path), ctx.damaged)
    row.notes = ctx.notes
    row.seconds = time.monotonic() - t_start
    return row


def select(names: list[str] | None, short: bool, pairs: bool = True) -> list[list[Fault]]:
    """The cases to run: the chosen faults (all, the short list, or --faults), then the pairs among them."""
    if names:
        unknown = [n for n in names if n not in FAULTS and "+" not in n]
        if unknown:
            from moetier.errors import InvalidArgument

            raise InvalidArgument(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        cases = [[FAULTS[p] for p in n.split("+")] for n in names]
        return cases
    singles = SHORT if short else list(FAULTS)
    chosen = [[FAULTS[n]] for n in singles]
    if pairs:
        chosen += [[FAULTS[a], FAULTS[b]] for a, b in (SHORT_PAIRS if short else PAIRS)]
    return chosen


async def run_matrix(root: Path, cases: list[list[Fault]], plan: Plan,
                     echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    cluster = ChaosCluster(root)
    t0 = time.monotonic()
    try:
        await asyncio.get_running_loop().run_in_executor(None, cluster.prepare)
        echo(f"chaos: cluster in {root} (tmpfs data dir: {cluster.tmpfs})")
        reference, ref_row = await reference_run(cluster, plan)
        echo(format_row(ref_row))
        rows = [ref_row]
        for case in cases:
            try:
                row = await run_case(cluster, case, reference, plan)
            except Exception as e:  # the harness could not run the case: a failure of it, then the next
                row = Row(" + ".join(f.name for f in case), recovery_s=None)
                row.checks.append({"check": "the case ran", "passed": False, "detail": f"{type(e).__name__}: {e}"})
            rows.append(row)
            echo(format_row(row))
    finally:
        await asyncio.get_running_loop().run_in_executor(None, cluster.close)
    return report(rows, plan, time.monotonic() - t0)


def report(rows: list[Row], plan: Plan, seconds: float) -> dict[str, Any]:
    ran = [r for r in rows if r.skipped is None]
    totals = {k: sum(getattr(r, k) for r in ran) for k in
              ("tried", "succeeded", "failed_clean", "failed_wrong", "hung", "tokens_wrong")}
    totals["lost"] = sum(len(r.lost) for r in ran)
    totals["checks_failed"] = sum(not c["passed"] for r in ran for c in r.checks)
    totals["not_recovered"] = sum(r.recovery_s is None for r in ran)
    return {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "plan": asdict(plan),
            "seconds": round(seconds, 1), "cases": [asdict(r) | {"bad": r.bad} for r in rows],
            "totals": totals, "skipped": [r.fault for r in rows if r.skipped is not None],
            "passed": not any(r.bad for r in rows)}


HEADER = (f"{'fault':<52} {'tried':>5} {'ok':>4} {'clean':>5} {'wrong':>5} {'hung':>4} {'tok!':>4} "
          f"{'recov s':>7} {'lost':>4} checks")


def format_row(r: Row) -> str:
    if r.skipped is not None:
        return f"{r.fault:<52} skipped: {r.skipped}"
    rec = "never" if r.recovery_s is None else f"{r.recovery_s:.1f}"
    checks = f"{sum(c['passed'] for c in r.checks)}/{len(r.checks)}" if r.checks else "-"
    line = (f"{r.fault:<52} {r.tried:>5} {r.succeeded:>4} {r.failed_clean:>5} {r.failed_wrong:>5} {r.hung:>4} "
            f"{r.tokens_wrong:>4} {rec:>7} {len(r.lost):>4} {checks}")
    extra = [*r.failures[:5], *r.lost[:3], *(f"check failed: {c['check']}: {c['detail']}" for c in r.checks
                                             if not c["passed"])]
    return line + "".join(f"\n    {e}" for e in extra)


def format_table(rep: dict[str, Any]) -> str:
    rows = [Row(**{k: v for k, v in c.items() if k != "bad"}) for c in rep["cases"]]
    t = rep["totals"]
    lines = [HEADER, *(format_row(r) for r in rows),
             f"{'total':<52} {t['tried']:>5} {t['succeeded']:>4} {t['failed_clean']:>5} {t['failed_wrong']:>5} "
             f"{t['hung']:>4} {t['tokens_wrong']:>4} {'':>7} {t['lost']:>4} {t['checks_failed']} failed",
             f"{len(rows) - len(rep['skipped'])} cases ran, {len(rep['skipped'])} skipped, {rep['seconds']:.0f} s; "
             + ("PASSED" if rep["passed"] else "FAILED")]
    return "\n".join(lines)
