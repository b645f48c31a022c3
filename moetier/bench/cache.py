"""`moetier bench cache`: hit rate of every RAM-tier policy beside Belady's optimum.

Each trace is replayed through the tier's own policy objects (moetier.store.sim,
the same decisions the live tier makes; a test checks they agree) at cache sizes
of 5/10/25/50% of all routed experts, and through Belady's MIN, the offline
optimum under the same rule that a layer's batch union is resident at once.

Traces:
  * routing traces recorded from models: the reference forward (the in-process
    Engine with a `TraceRecorder`) of each model over 128 tokens of the shipped text
    plus 128 greedy tokens, batch 1 (prefill steps included), recorded once and kept
    next to the model (moetier.bench.models). By default the tiny MLA model, the
    trained demo model (the only trained router: scripts/train_demo.py; the shipped
    text is held out from its training) and the benchmark model (mini-glm); the
    output says which weights are random; `--model DIR` (repeatable) names others;
  * routing trace files (`--trace FILE.npz`, format in moetier.store.trace); given
    alone, they replace the recorded ones;
  * synthetic ones: `zipf` (independent tokens, Zipf popularity per layer) and
    `temporal` (plus per-sequence topics, expert reuse between consecutive tokens,
    sequence churn).

Each recorded trace is also replayed as its decode steps alone (`<model> decode`):
prefill steps route a whole chunk of prompt tokens at once, and on a small model
that batch union is every expert of a layer, which raises every cache size to the
whole layer. The decode steps are those whose every layer routes exactly the
trace's smallest union (batch 1: the top-k of one token).

`learned+history` is the learned policy after a restart: its usage history comes
from a previous run of other traffic on the same model (recorded traces: another
shipped text; synthetic traces: another seed). The headline `ratio` is best
cold-start policy / Belady at 10%, on the benchmark model's trace when it is
recorded, else on the first trace file or recorded trace, else on `temporal`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from moetier.bench import models
from moetier.errors import InvalidArgument
from moetier.settings import load_settings
from moetier.store.policy import POLICIES, Learned, make_policy
from moetier.store.sim import belady, simulate
from moetier.store.trace import SynthSpec, Trace, load_trace, temporal_trace, trace_stats, zipf_trace

SIZES = (0.05, 0.10, 0.25, 0.50)
TINY_PRESET = "tiny-deepseek_v3"  # the tiny MLA model of the cluster tests


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "cache", help="hit rate of lru/lfu/learned vs Belady's optimum at 5-50%% cache sizes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", action="append", default=[], metavar="FILE.npz",
                   help="routing trace file (repeatable); given alone, no model is run")
    p.add_argument("--model", action="append", default=[], type=Path, metavar="DIR",
                   help="container whose reference forward is recorded (repeatable; default: "
                        f"{TINY_PRESET} and the benchmark model, {models.BENCHMARK_PRESET})")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the models live)")
    p.add_argument("--no-models", action="store_true", help="no recorded traces (trace files and synthetic only)")
    p.add_argument("--prompt-tokens", type=int, default=models.TRACE_PROMPT_TOKENS,
                   help=f"prompt tokens of shipped text per recording (default {models.TRACE_PROMPT_TOKENS})")
    p.add_argument("--tokens", type=int, default=models.TRACE_TOKENS,
                   help=f"greedy tokens generated per recording (default {models.TRACE_TOKENS})")
    p.add_argument("--no-synthetic", action="store_true", help="no synthetic traces")
    s = SynthSpec()
    p.add_argument("--steps", type=int, default=s.steps, help=f"synthetic decode steps (default {s.steps})")
    p.add_argument("--layers", type=int, default=s.layers, help=f"synthetic MoE layers (default {s.layers})")
    p.add_argument("--experts", type=int, default=s.n_experts, help=f"experts per layer (default {s.n_experts})")
    p.add_argument("--top-k", type=int, default=s.top_k, help=f"experts per token (default {s.top_k})")
    p.add_argument("--batch", type=int, default=s.batch, help=f"sequences per step (default {s.batch})")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = SynthSpec(layers=args.layers, n_experts=args.experts, top_k=args.top_k, batch=args.batch,
                     steps=args.steps)
    if args.prompt_tokens < 1 or args.tokens < 1:
        raise InvalidArgument("--prompt-tokens and --tokens must be >= 1")
    traces: list[dict[str, Any]] = []
    for f in args.trace:
        tr, n_experts = load_trace(f)
        traces.append({"name": Path(f).stem, "kind": "routing", "trace": tr, "n_experts": n_experts,
                       "history_from": None})
    bench_model: str | None = None
    if not args.no_models and (args.model or not args.trace):
        dirs = list(args.model)
        if not dirs:
            from moetier.engine import ensure_demo_model, trained_demo_source

            settings = load_settings(args.config)
            dirs = [models.benchmark_model(TINY_PRESET, settings)]
            if trained_demo_source() is not None:  # the one trained router among them
                dirs.append(ensure_demo_model(settings))
            dirs.append(models.benchmark_model(models.BENCHMARK_PRESET, settings))
            bench_model = dirs[-1].name
        for d in dirs:
            rec = _recorded(Path(d), args.prompt_tokens, args.tokens)
            traces.append(rec)
            dec = decode_only(rec["trace"])
            if 0 < len(dec) < len(rec["trace"]):
                hist = decode_only(rec["history_from"])
                traces.append({**rec, "name": f"{rec['name']} decode", "trace": dec, "history_from": hist or None,
                               "source": f"{rec['source']}; its {len(dec)} decode steps alone"})
    if not args.no_synthetic:
        for name, gen in (("zipf", zipf_trace), ("temporal", temporal_trace)):
            traces.append({"name": name, "kind": "synthetic", "trace": gen(spec, args.seed + 1, args.seed),
                           "n_experts": spec.n_experts, "history_from": gen(spec, args.seed + 2, args.seed)})
    if not traces:
        raise InvalidArgument("no trace: give --trace FILE.npz or --model DIR, or allow the synthetic ones")
    t0 = time.perf_counter()
    results = [evaluate(t["name"], t["kind"], t["trace"], t["n_experts"], t["history_from"]) for t in traces]
    for r, t in zip(results, traces, strict=True):
        if "source" in t:
            r["source"] = t["source"]
    head = (next((r for r in results if r["name"] == bench_model), None)
            or next((r for r in results if r["kind"] == "routing"), None)
            or next(r for r in results if r["name"] == "temporal" or r["kind"] == "synthetic"))
    out = {"name": "cache", "sizes": list(SIZES), "traces": results, "ratio_trace": head["name"],
           "ratio": head["best_over_belady_10"], "ratio_policy": head["best_at_10"],
           "learned_ge_lru": all(d >= 0 for r in results for d in r["learned_minus_lru"]),
           "seconds": time.perf_counter() - t0,
           "synthetic": {"layers": spec.layers, "experts": spec.n_experts, "top_k": spec.top_k,
                         "batch": spec.batch, "steps": spec.steps, "alpha": spec.alpha}}
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return 0


def decode_only(trace: Trace) -> Trace:
    """The steps whose every layer routes exactly the trace's smallest union: a batch-1
    recording's decode steps (one token: its top-k), without the prefill steps."""
    sizes = [np.unique(ids).size for step in trace for _, ids in step]
    if not sizes:
        return []
    k = min(sizes)
    return [step for step in trace if step and all(np.unique(ids).size == k for _, ids in step)]


def _recorded(model: Path, prompt_tokens: int, tokens: int) -> dict[str, Any]:
    """The model's routing over one shipped text, with its routing over another as the
    previous traffic the learned policy's history comes from."""
    main, previous = (models.recorded_trace(model, prompt_tokens, tokens, text) for text in models.TRACE_TEXTS)
    tr, n_experts = load_trace(main)
    prev, _ = load_trace(previous)
    return {"name": model.name, "kind": "routing", "trace": tr, "n_experts": n_experts, "history_from": prev,
            "source": f"{model} ({_weights(model)}): {prompt_tokens} prompt + {tokens} generated tokens, batch 1"}


def _weights(model: Path) -> str:
    """Whether a container's router was trained (a converted checkpoint) or is random (synth)."""
    try:
        source = json.loads((model / models.MANIFEST).read_text()).get("source", {})
    except (OSError, ValueError):
        return "weights unknown"
    if source.get("kind") == "synth":
        return f"random weights, synth preset {source.get('preset')}"
    return "trained weights" if source.get("kind") == "hf" else f"{source.get('kind')} weights"


def evaluate(name: str, kind: str, trace: Trace, n_experts: int, history_from: Trace | None) -> dict[str, Any]:
    layers = sorted({layer for step in trace for layer, _ in step})
    total = len(layers) * n_experts
    st = trace_stats(trace)
    # a layer's whole batch union (in the trace and in the history's) must fit: smaller caches are
    # raised to that floor
    floor = max(np.unique(ids).size for tr in (trace, history_from or []) for step in tr for _, ids in step)
    caps = [max(floor, int(frac * total)) for frac in SIZES]
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    if history_from is not None:
        rates["learned+history"] = []
    rates["belady"] = []
    for cap in caps:
        for p in POLICIES:
            h, n = simulate(make_policy(p, layers, n_experts, cap), trace, cap)
            rates[p].append(h / n)
        if history_from is not None:
            prev = make_policy("learned", layers, n_experts, cap)
            simulate(prev, history_from, cap)  # the previous run
            assert isinstance(prev, Learned)
            warm = make_policy("learned", layers, n_experts, cap, history=prev.history())
            h, n = simulate(warm, trace, cap)
            rates["learned+history"].append(h / n)
        h, n = belady(trace, cap)
        rates["belady"].append(h / n)
    i10 = SIZES.index(0.10)
    best = max(POLICIES, key=lambda p: rates[p][i10])
    b10 = rates["belady"][i10]
    return {"name": name, "kind": kind, "layers": len(layers), "experts": n_experts, "steps": st["steps"],
            "capacity": caps,
            "accesses": int(st["accesses"]), "mean_union": st["mean_union"], "hit_rate": rates,
            "best_at_10": best, "best_over_belady_10": rates[best][i10] / b10 if b10 else 0.0,
            "learned_minus_lru": [a - b for a, b in zip(rates["learned"], rates["lru"], strict=True)]}


def _print(out: dict[str, Any]) -> None:
    print("moetier bench cache: hit rate (demanded experts found in RAM) by cache size, % of all routed experts")
    for r in out["traces"]:
        print(f"\n{r['name']} ({r['kind']}): {r['layers']} layers x {r['experts']} experts, {r['steps']} steps, "
              f"{r['accesses']} accesses, mean batch union {r['mean_union']:.1f}")
        if "source" in r:
            print(f"  recorded from {r['source']}")
        print(f"{'policy':<16}" + "".join(f"{int(s * 100):>8}%" for s in out["sizes"]))
        print(f"{'(experts)':<16}" + "".join(f"{c:>9d}" for c in r["capacity"]))
        for p, v in r["hit_rate"].items():
            print(f"{p if p != 'belady' else 'belady (MIN)':<16}" + "".join(f"{x:>9.3f}" for x in v))
        print(f"{'learned - lru':<16}" + "".join(f"{x:>+9.3f}" for x in r["learned_minus_lru"]))
        if r["hit_rate"]["belady"][SIZES.index(0.10)] > 0:
            print(f"best at 10%: {r['best_at_10']}, {r['best_over_belady_10']:.3f} of Belady")
        else:  # the cache holds one layer's union: every layer evicts the one before
            print("best at 10%: none, no policy can hit (Belady 0)")
    print(f"\nlearned >= lru at every size on every trace: {'yes' if out['learned_ge_lru'] else 'NO'}")
    print(f"ratio = best policy ({out['ratio_policy']}) / Belady at 10% on {out['ratio_trace']}: {out['ratio']:.3f}"
          f"   ({out['seconds']:.0f} s)")
