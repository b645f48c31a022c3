"""`moetier chaos`: the docs' fault table is the harness's matrix; the test hooks; the outcome
checks against a fake gateway; what counts as a persisted record lost; and the short form of
the harness run for real (the CI form: every request checked, none failed wrongly, hung or got
wrong tokens, nothing persisted lost)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_store import records
from helpers_up import moetier_argv

from moetier.chaos.faults import FAULTS, PAIRS, SHORT, SHORT_PAIRS, fault_table
from moetier.chaos.persist import Persisted
from moetier.chaos.workload import Spec, check_tokens, run_one, spec
from moetier.store.io import IOEngine
from moetier.testhooks import FileValue, OffsetClock, ReadDelay

DOC = Path(__file__).parent.parent / "docs" / "reliability.md"


def test_the_docs_table_is_the_harness_matrix() -> None:
    doc = DOC.read_text()
    assert fault_table() in doc, ("docs/reliability.md's fault table differs from the harness's: paste "
                                  "`python -c 'from moetier.chaos.faults import fault_table; print(fault_table())'`")
    for name in FAULTS:
        assert f"`{name}`" in doc
    assert all(a in FAULTS and b in FAULTS for a, b in [*PAIRS, *SHORT_PAIRS])
    assert set(SHORT) <= set(FAULTS)
    for a, b in PAIRS:
        assert f"`{a}` + `{b}`" in doc, f"pair {a} + {b} is not listed in docs/reliability.md"


# ---- the test hooks ------------------------------------------------------------------------

def test_file_value_reads_the_file_again_once_a_second_and_refuses_nonsense(tmp_path: Path) -> None:
    f = tmp_path / "v"
    v = FileValue(f, 0.0, 10.0, recheck_s=0.05)
    assert v() == 0.0  # no file
    f.write_text("0.25\n")
    time.sleep(0.06)
    assert v() == 0.25
    f.write_text("nan")
    time.sleep(0.06)
    assert v() == 0.0
    f.write_text("11")  # out of range
    time.sleep(0.06)
    assert v() == 0.0
    f.write_text("3")
    assert v() == 0.0  # not re-read within recheck_s
    time.sleep(0.06)
    assert v() == 3.0


def test_offset_clock_moves_with_its_file(tmp_path: Path) -> None:
    f = tmp_path / "clock"
    f.write_text("-30")
    clock = OffsetClock(f, recheck_s=0.0)
    assert clock() - time.monotonic() == pytest.approx(-30, abs=1)
    f.write_text("100")
    assert clock() - time.monotonic() == pytest.approx(100, abs=1)


def test_io_engine_sleeps_the_read_delay_before_every_read(tmp_path: Path) -> None:
    index = records(tmp_path)
    calls = []

    def delay() -> float:
        calls.append(1)
        return 0.0

    with IOEngine(index, depth=2, direct=False, read_delay=delay) as engine:
        keys = sorted(k for k, _ in index)[:5]
        engine.read(keys)
    assert len(calls) == 5
    f = tmp_path / "delay"
    f.write_text("0.2")
    with IOEngine(index, depth=1, direct=False, read_delay=ReadDelay(f)) as engine:
        t0 = time.monotonic()
        engine.read(sorted(k for k, _ in index)[:2])
        assert time.monotonic() - t0 >= 0.4  # a lower bound: a slow machine only adds to it


# ---- the outcome checks -----------------------------------------------------------------------

def _sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


ERR = {"error": {"message": "no worker", "type": "service_unavailable", "param": None,
                 "code": "service_unavailable"}}
OK_BODY = {"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}], "usage": {"completion_tokens": 4}}

# (stream?, status, headers, body, allowed) -> kind
CASES: list[tuple[str, bool, int, dict[str, str], bytes, frozenset[int | str], str]] = [
    ("plain ok", False, 200, {}, json.dumps(OK_BODY).encode(), frozenset(), "ok"),
    ("503 allowed", False, 503, {}, json.dumps(ERR).encode(), frozenset({503}), "clean"),
    ("503 not allowed", False, 503, {}, json.dumps(ERR).encode(), frozenset({429}), "wrong"),
    ("503 without envelope", False, 503, {}, b'{"detail": "x"}', frozenset({503}), "wrong"),
    ("429 without Retry-After", False, 429, {}, json.dumps(ERR).encode(), frozenset({429}), "wrong"),
    ("429 with Retry-After", False, 429, {"retry-after": "2"}, json.dumps(ERR).encode(), frozenset({429}), "clean"),
    ("stream ok", True, 200, {}, _sse(_chunk("a"), _chunk("b", "stop"), "[DONE]"), frozenset(), "ok"),
    ("stream error event", True, 200, {}, _sse(_chunk("a"), ERR, "[DONE]"), frozenset({503}), "clean"),
    ("stream error event not allowed", True, 200, {}, _sse(_chunk("a"), ERR, "[DONE]"), frozenset(), "wrong"),
    ("stream cut silently", True, 200, {}, _sse(_chunk("a")), frozenset({503}), "wrong"),
    ("stream cut, gateway gone", True, 200, {}, _sse(_chunk("a")), frozenset({"transport"}), "clean"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outcomes_are_classified(case: tuple[str, bool, int, dict[str, str], bytes, frozenset[int | str], str]) -> None:
    _, stream, status, headers, body, allowed, kind = case
    s = Spec(0, "chat", stream, 4, 0.0, None, 1.0, "hi")
    transport = httpx.MockTransport(lambda r: httpx.Response(status, headers=headers, content=body))

    async def go() -> str:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return (await run_one(client, s, allowed, 10)).kind

    assert asyncio.run(go()) == kind


def test_greedy_tokens_are_checked_against_the_reference_and_a_cut_stream_against_its_prefix() -> None:
    from moetier.chaos.workload import Outcome

    s = spec(0)
    assert s.greedy
    ref = {s.key: "hello world"}
    outs = [Outcome(0, "ok", text="hello world"), Outcome(0, "ok", text="hello there"),
            Outcome(0, "clean", text="hello"), Outcome(0, "clean", text="help")]
    check_tokens([s] * 4, outs, ref)
    assert [o.tokens_wrong for o in outs] == [False, True, False, True]


def test_an_entry_is_lost_unless_a_longer_one_holds_it_or_the_fault_damaged_it() -> None:
    before = Persisted({"a.kv": (1, 2, 3), "b.kv": (5, 6), "c.kv": (7,)}, history=10.0)
    after = Persisted({"d.kv": (1, 2, 3, 4), "c.kv": (7,)}, history=12.0)
    assert before.lost(after, set()) == ["prefix-cache entry b.kv (2 tokens)"]
    assert before.lost(after, {"b.kv"}) == []
    assert before.lost(Persisted(after.entries, history=9.0), {"b.kv"}) == [
        "usage history counts (9 < 10 before)"]
    assert before.lost(Persisted(after.entries, history=None), {"b.kv", "history"}) == []


def test_unknown_fault_is_refused() -> None:
    r = subprocess.run([*moetier_argv(), "chaos", "--faults", "kill-everything"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "kill-everything" in r.stderr and "kill-router-restart" in r.stderr


# ---- the harness, short form ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_form_fails_no_request_wrongly_and_loses_nothing(tmp_path: Path) -> None:
    r = subprocess.run([*moetier_argv(), "chaos", "--short", "--json", "--dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=850)
    assert r.stdout.strip(), r.stderr[-3000:]
    rep = json.loads(r.stdout)
    names = [c["fault"] for c in rep["cases"]]
    assert names[0] == "none (reference)" and set(SHORT) <= set(names), names
    assert [" + ".join(p) for p in SHORT_PAIRS] == [n for n in names if " + " in n]
    t = rep["totals"]
    problems = [f"{c['fault']}: {c['failures'][:3]} {c['lost'][:3]} "
                f"{[x for x in c['checks'] if not x['passed']]}" for c in rep["cases"] if c["bad"]]
    assert t["failed_wrong"] == t["hung"] == t["tokens_wrong"] == t["lost"] == 0, problems
    assert t["checks_failed"] == 0 and t["not_recovered"] == 0, problems
    assert rep["passed"] and r.returncode == 0, problems
    ran = [c for c in rep["cases"] if c["skipped"] is None]
    assert all(c["tried"] > 0 for c in ran)
    # the faults bit: some requests failed (cleanly), and the persistence check had records to check
    assert t["failed_clean"] > 0 and t["succeeded"] > 0
    assert any(c["persisted"] > 1 for c in ran), "nothing was persisted: the lost-records check checked nothing"


def test_a_health_check_answered_by_something_else_is_not_healthy() -> None:
    """Found by `moetier chaos` (slow-reader + kill-gateway-restart): while the gateway restarted,
    something else answered on its port with bytes that are not HTTP, and http_healthy raised
    BadStatusLine out of the supervisor instead of answering "not healthy"."""
    import socket
    import threading

    from moetier.launch import http_healthy

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff")  # an HTTP/2 SETTINGS frame
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert http_healthy(f"http://127.0.0.1:{port}/health", timeout_s=5) is False
    finally:
        t.join(5)
        srv.close()
