"""`moetier bench spec`: the same requests with speculative decoding off and on, side by side.

The model is a synth preset with an MTP head (default `demo`, built once under data_dir/models;
`--preset mini-glm` for the DeepSeek-V2-Lite-sized one, `--model DIR` for any container with a
head), served by the in-process engine (resident dense part, FastOps, the expert RAM tier with
O_DIRECT reads) at each `--budgets` size of its expert bytes (default 100% and 25%). At each
size three modes run, alternately over `--rounds` (ABC then CBA, so drift hits all):

  * off:   no drafts (the plain decoder);
  * auto:  up to `--k` drafts per step, as many as the cost model (moetier.speculation) says pay;
  * fixed: always `--k` drafts.

Each run opens a fresh engine (tier empty; the page cache dropped where root) and generates
`--tokens` greedy tokens for each of `--requests` prompts of `--prompt-tokens` shipped-text
tokens at batch 1. Reported per mode: decode tok/s (first to last token of each request), tokens
per forward, acceptance (overall and per draft position), what the controller chose (steps per
k, steps off by reason), and the mean decode forward beside its bounds, counted from the tier's
stats over the decode steps: disk bound = missed expert bytes / fio GB/s (randread O_DIRECT at
the record size, measured in the run), memory bound = (touched expert bytes + the dense bytes a
step reads) / memory GB/s (a numpy copy). At temperature 0 every mode must produce the same
tokens (`tokens_match`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moetier.bench import models
from moetier.bench.compute import copy_gbps
from moetier.bench.io import _drop_page_cache, _fio_pass, find_fio
from moetier.errors import InvalidArgument

MODES = ("off", "auto", "fixed")
DEFAULT_PRESET = "demo"


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("spec", help="speculative decoding (MTP drafts) off and on, "
                                                "side by side, at two expert-cache sizes")
    p.add_argument("--model", type=Path, help="container with an MTP head (default: the --preset benchmark model)")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"synth preset to build when no --model (default "
                   f"{DEFAULT_PRESET})")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the benchmark model lives)")
    p.add_argument("--budgets", default="100%,25%", help="expert RAM tier sizes, comma-separated (default 100%%,25%%)")
    p.add_argument("--k", type=int, default=3, help="most drafts per step (auto), drafts per step (fixed)")
    p.add_argument("--requests", type=int, default=4, help="requests per run (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per request (default 48)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per budget (default 2: ABC, CBA)")
    p.add_argument("--threads", type=int, help="kernel threads (default: every CPU)")
    p.add_argument("--fio-records", type=int, default=64, help="records fio reads per budget (default 64)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


@dataclass
class Run:
    mode: str
    budget: str
    seconds: float = 0.0  # decode time (first to last token), all requests
    tokens: int = 0  # decode tokens (after each first)
    forwards: int = 0  # decode forwards
    misses: int = 0  # expert misses over the decode steps
    touched: int = 0  # experts of the decode steps' unions
    drafted: int = 0
    accepted: int = 0
    by_position: list[float] = field(default_factory=list)
    k_chosen: dict[int, int] = field(default_factory=dict)
    off: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    from moetier.settings import load_settings
    from moetier.text.tokenizer import TextTokenizer
    from moetier.weights.container import Container

    if args.k < 1 or args.requests < 1 or args.tokens < 2 or args.rounds < 1:
        raise InvalidArgument("--k, --requests and --rounds must be >= 1, --tokens >= 2")
    model = models.resolve_model(args, args.preset)
    settings = load_settings(args.config)
    with Container.open(model) as c:
        if c.mtp is None:
            raise InvalidArgument(f"{model} has no MTP head (converted with --mtp none, or built before moetier "
                                  "wrote one): nothing to draft with; remove it to rebuild, or give --model")
        record = c.layout.record_bytes
        files = [c.path / "experts" / f for f in c.index.files]
        dense = 0
        for name in c.dense_names():
            t = c.dense(name)
            n = t.data.nbytes + (t.scales.nbytes if t.scales is not None else 0)
            dense += n // t.shape[0] if name == "embed" else n  # one embedding row per token
        tok = TextTokenizer.from_dir(model)
        prompts = [models.prompt_ids(tok, args.prompt_tokens, i) for i in range(args.requests)]
    fio = find_fio("spec", "the disk bound is measured with it")
    src = np.ones(64 << 18, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    mem_gbps = max(copy_gbps(src, dst) for _ in range(3))
    root = os.geteuid() == 0
    results: dict[str, Any] = {"model": str(model), "k": args.k, "memory_gbps": mem_gbps, "budgets": {}}
    for budget in [b.strip() for b in args.budgets.split(",") if b.strip()]:
        disk_gbps = None
        if fio is not None:
            nbytes, secs = _fio_pass(fio, files, record, settings.storage.queue_depth, args.fio_records, "libaio")
            disk_gbps = nbytes / secs / 1e9
        runs: dict[str, list[Run]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                if root:
                    _drop_page_cache()
                runs[mode].append(_run(model, mode, budget, args, prompts))
        results["budgets"][budget] = _summary(runs, record, dense, disk_gbps, mem_gbps)
    print(json.dumps(results, indent=2) if args.json else _format(results))
    return 0 if all(b["tokens_match"] for b in results["budgets"].values()) else 1


def _run(model: Path, mode: str, budget: str, args: argparse.Namespace, prompts: list[list[int]]) -> Run:
    from moetier.engine import Engine
    from moetier.model.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    out = Run(mode, budget)
    k = 0 if mode == "off" else args.k
    with Engine.open(model, budget=budget, threads=args.threads, speculative=k, fixed_k=mode == "fixed") as e:
        tier = e.experts.tier
        for ids in prompts:
            gen = e.generate(ids, params)
            toks = [next(gen).token]
            s0 = tier.stats()
            steps0 = e.spec_stats.steps
            t0 = time.perf_counter()
            toks += [g.token for g in gen]
            out.seconds += time.perf_counter() - t0
            s1 = tier.stats()
            out.tokens += len(toks) - 1
            out.forwards += (e.spec_stats.steps - steps0) if k else len(toks) - 1
            miss = sum(s1.misses.values()) - sum(s0.misses.values())
            out.misses += miss
            out.touched += miss + sum(s1.hits.values()) - sum(s0.hits.values())
            out.outputs.append(toks)
        st = e.spec_stats
        out.drafted, out.accepted = st.drafted, st.accepted
        out.k_chosen, out.off = dict(st.k_chosen), dict(st.off)
        ctl = e.controller
        out.by_position = [float(a / d) if d else 0.0 for a, d in zip(ctl.accepted, ctl.drafted, strict=True)]
    return out


def _summary(runs: dict[str, list[Run]], record: int, dense: int, disk_gbps: float | None,
             mem_gbps: float) -> dict[str, Any]:
    out: dict[str, Any] = {"disk_gbps": disk_gbps, "modes": {}}
    ref = runs["off"][0].outputs
    out["tokens_match"] = all(r.outputs == ref for rs in runs.values() for r in rs)
    for mode, rs in runs.items():
        fw = sum(r.forwards for r in rs) or 1
        step_s = sum(r.seconds for r in rs) / fw
        missed_b = sum(r.misses for r in rs) * record / fw
        touched_b = sum(r.touched for r in rs) * record / fw + dense
        disk_s = missed_b / (disk_gbps * 1e9) if disk_gbps else None
        mem_s = touched_b / (mem_gbps * 1e9)
        drafted = sum(r.drafted for r in rs)
        k_chosen: dict[str, int] = {}
        off: dict[str, int] = {}
        for r in rs:
            for kk, v in r.k_chosen.items():
                k_chosen[str(kk)] = k_chosen.get(str(kk), 0) + v
            for why, v in r.off.items():
                off[why] = off.get(why, 0) + v
        out["modes"][mode] = {
            "tok_s": [r.tokens / r.seconds if r.seconds else 0.0 for r in rs],
            "tok_s_median": statistics.median(r.tokens / r.seconds if r.seconds else 0.0 for r in rs),
            "tokens_per_forward": sum(r.tokens for r in rs) / fw,
            "acceptance": sum(r.accepted for r in rs) / drafted if drafted else None,
            "acceptance_by_position": [statistics.mean(x) for x in zip(*(r.by_position for r in rs), strict=True)]
            if drafted else [],
            "steps_by_k": k_chosen, "steps_off_by_reason": off,
            "step_s": step_s, "missed_bytes_per_step": missed_b, "touched_bytes_per_step": touched_b,
            "disk_bound_s": disk_s, "memory_bound_s": mem_s,
            "bound_s": max(x for x in (disk_s, mem_s) if x is not None),
        }
    return out


def _format(r: dict[str, Any]) -> str:
    lines = [f"model {r['model']}: speculative decoding off / auto (up to {r['k']}) / fixed {r['k']}, "
             f"memory {r['memory_gbps']:.1f} GB/s (numpy copy)"]
    for budget, b in r["budgets"].items():
        disk = f"{b['disk_gbps']:.2f} GB/s (fio randread O_DIRECT)" if b["disk_gbps"] else "not measured (no fio)"
        lines.append(f"expert cache {budget}: disk {disk}; tokens {'match' if b['tokens_match'] else 'DIFFER'}")
        for mode, m in b["modes"].items():
            acc = "-" if m["acceptance"] is None else (
                f"{m['acceptance']:.2f} (" + ", ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) + ")")
            disk_b = "-" if m["disk_bound_s"] is None else f"{1e3 * m['disk_bound_s']:.2f}"
            lines.append(f"  {mode:5s} {m['tok_s_median']:7.1f} tok/s  {m['tokens_per_forward']:.2f} tok/forward  "
                         f"acceptance {acc}  step {1e3 * m['step_s']:.2f} ms (disk bound {disk_b} ms, memory bound "
                         f"{1e3 * m['memory_bound_s']:.2f} ms; {m['missed_bytes_per_step'] / 2**20:.2f} MiB missed)"
                         + (f"  steps by k {m['steps_by_k']} off {m['steps_off_by_reason']}" if mode != "off" else ""))
    return "\n".join(lines)
