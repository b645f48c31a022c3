"""The measurement: blocks of (precision, regime), rounds of fresh starts, one client.

A block runs its systems `rounds` times, rotating their order every round (each system goes
first once in three rounds), so slow drifts of a shared machine hit all of them. One trial:

  1. drop the page cache (root), make the system's cgroup (the cap, in the capped regime),
     set the disk's read-ahead if the row asks for one;
  2. start the server; read each of its processes' RSS (the baseline, before any request);
  3. warm-up: one completion of `prefill_tokens` tokens of another text, 1 token out (all
     experts and pages a prompt touches come in; untimed);
  4. decode: the `prompt_tokens`-token prompt, `tokens` greedy tokens -> TTFT, decode tok/s,
     CPU cores busy and disk bytes read during decode; then the same request again (TTFT of
     a repeated prompt: what a prefix cache saves);
  5. prefill: `prefill_tokens` tokens of a text no earlier request shared a prefix with (a
     different one each round), 1 token out -> prefill tok/s = prompt tokens / TTFT;
  6. peak memory (the cgroup's, page cache included; the summed RSS, sampled), stop.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from moetier.bench.peers.client import Counters, Timed, complete
from moetier.bench.peers.sandbox import CGROUP_PREFIX, Cgroup, ReadAhead, drop_page_cache
from moetier.bench.peers.systems import MoetierInProcess, MoetierUp, System
from moetier.errors import MoetierError

Say = Callable[[str], None]


@dataclass
class Prompts:
    decode: str  # the short prompt decoded from
    warmup: str
    prefill: list[str]  # one per round
    token_counts: dict[str, int] = field(default_factory=dict)  # as moetier tokenizes them


@dataclass
class Row:
    """One system of a block: how to make a fresh instance for a trial."""

    label: str
    make: Callable[[Path], System]
    read_ahead_kb: int | None = None  # set for this row's trials (None: the machine's setting)
    baseline_of: str | None = None  # label of the row this one's ratio is taken against


@dataclass
class Block:
    precision: str
    regime: str  # "resident" | "capped"
    rows: list[Row]
    cap_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@contextlib.contextmanager
def _trial_env(row: Row, ra: ReadAhead | None) -> Iterator[None]:
    if row.read_ahead_kb is not None and ra is not None:
        with ra.set(row.read_ahead_kb):
            yield
    else:
        yield


def _request(system: System, prompt: str, max_tokens: int) -> Timed:
    sb = system.sandbox

    def counters(disk: bool = True) -> Counters:
        return Counters(time.perf_counter(), sb.cpu_seconds(), sb.read_bytes() if disk else 0)

    return complete(system.url, system.model_name, prompt, max_tokens, counters, usage=system.usage)


def _timed(t: Timed) -> dict[str, Any]:
    return {"ttft_s": t.ttft_s, "total_s": t.total_s, "tokens": t.tokens, "usage_tokens": t.usage_tokens,
            "decode_tok_s": t.decode_tok_s, "cores_busy": t.cores_busy, "read_bytes": t.read_bytes,
            "finish_reason": t.finish_reason}


def trial(row: Row, block: Block, rnd: int, prompts: Prompts, work: Path, *, cpus: list[int],
          tokens: int, use_cgroups: bool, ra: ReadAhead | None, say: Say) -> dict[str, Any]:
    system = row.make(work / f"{block.precision}-{block.regime}-{_slug(row.label)}-r{rnd}")
    system.label = row.label
    cg = Cgroup(f"{CGROUP_PREFIX}{os.getpid()}", limit_bytes=block.cap_bytes) if use_cgroups else None
    out: dict[str, Any] = {"round": rnd}
    dropped = drop_page_cache()
    try:
        if cg is not None:
            cg.create()
        with _trial_env(row, ra):
            out["read_ahead_kb"] = ra.get() if ra is not None else None
            t0 = time.perf_counter()
            system.start(cg, cpus)
            out["start_s"] = time.perf_counter() - t0
            out["baseline_rss"] = system.baseline()
            out["page_cache_dropped"] = dropped
            t0 = time.perf_counter()
            _request(system, prompts.warmup, 1)
            out["warmup_s"] = time.perf_counter() - t0
            d1 = _request(system, prompts.decode, tokens)
            d2 = _request(system, prompts.decode, tokens)
            pf = _request(system, prompts.prefill[rnd % len(prompts.prefill)], 1)
            n_prefill = prompts.token_counts.get(f"prefill{rnd % len(prompts.prefill)}", 0)
            out["decode"] = _timed(d1)
            out["decode_repeat"] = _timed(d2)
            out["prefill"] = {**_timed(pf), "prompt_tokens": n_prefill,
                              "prefill_tok_s": n_prefill / pf.ttft_s if pf.ttft_s > 0 else None}
            out["texts"] = [d1.text, d2.text]
            out["peak_rss"] = system.sandbox.peak_rss
            out["peak_rss_by_process"] = system.peaks()
            out["peak_memory"] = system.sandbox.peak_memory()
            if cg is not None:
                out["memory_stat"] = {k: v for k, v in cg.memory_stat().items()
                                      if k in ("rss", "cache", "mapped_file", "hierarchical_memory_limit")}
    except (MoetierError, httpx.HTTPError, OSError) as e:
        # a system that cannot start or serve here (killed under the cap, say) is a result too
        out["error"] = f"{type(e).__name__}: {e}"
        out["log_tail"] = _tail(system.work / "server.log")
        say(f"  {row.label:<40} round {rnd + 1}: FAILED {out['error'][:400]}")
        return out
    finally:
        system.stop()
        if cg is not None:
            cg.remove()
    say(f"  {row.label:<40} round {rnd + 1}: TTFT {out['decode']['ttft_s']:.2f} s, decode "
        f"{_fmt(out['decode']['decode_tok_s'])} tok/s, prefill {_fmt(out['prefill']['prefill_tok_s'])} tok/s")
    return out


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_block(block: Block, rounds: int, prompts: Prompts, work: Path, *, cpus: list[int], tokens: int,
              use_cgroups: bool, ra: ReadAhead | None, say: Say) -> dict[str, list[dict[str, Any]]]:
    say(f"{block.precision} {block.regime}" + (f" (cap {block.cap_bytes / 1e9:.2f} GB)" if block.cap_bytes else ""))
    results: dict[str, list[dict[str, Any]]] = {r.label: [] for r in block.rows}
    n = len(block.rows)
    for rnd in range(rounds):
        order = block.rows[rnd % n:] + block.rows[:rnd % n]
        for row in order:
            results[row.label].append(trial(row, block, rnd, prompts, work, cpus=cpus, tokens=tokens,
                                            use_cgroups=use_cgroups, ra=ra, say=say))
    return results


def moetier_footprint(model: Path, work: Path, cpus: list[int], in_process: bool) -> dict[str, int]:
    """moetier's memory without experts: each process's RSS right after a start with an expert
    cache of 1% (what the capped regime's expert cache must leave room for)."""
    cls = MoetierInProcess if in_process else MoetierUp
    system = cls(label="moetier footprint probe", kind="moetier", work=work, model=model, expert_cache="1%")
    try:
        system.start(None, cpus)
        return system.baseline()
    finally:
        system.stop()
