"""`moetier simulate`: the trace-driven simulator (moetier/simulate.py) on its own.

    moetier simulate --preset glm-5 --cache 100GB --disk-gbps 7 --memory-gbps 60
    moetier simulate --calibrate e2e-10.json e2e-25.json e2e-50.json

Without --calibrate: decode at batch 1 with an expert cache of `--cache` (bytes or a share of the
expert bytes), cold and warm, over a routing trace (`--trace FILE`, else the synthetic one at the
model's shape); the rates as `moetier plan` takes them.

--calibrate: each file is one `moetier bench e2e --json` run. The simulator replays the routing of
that run's own requests (the benchmark's prompt of shipped text and its greedy tokens, recorded
from the reference forward of the same container: placement changes no routing), with that run's
cache budget and policy, its measured fio and memory GB/s and prefetch recall, and prints its
prediction beside the measurement, per system and request, with the error. Nothing is fitted:
the figures going in are the run's own measurements.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moetier.commands.plan import costs_of, machine_of
from moetier.errors import InvalidArgument
from moetier.settings import load_settings, resolve_budget


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("simulate", help="trace-driven decode simulator; --calibrate "
                                                "against bench e2e runs")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", type=Path, help="container directory (default: settings model.path)")
    what.add_argument("--preset", help="a synth preset's shape (e.g. glm-5)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--experts", default="int4", choices=["int4", "int8", "bf16", "f32"], help="preset: experts")
    p.add_argument("--dense", default="int8", choices=["int4", "int8", "bf16", "f32"], help="preset: dense")
    p.add_argument("--group-size", type=int, default=64, help="preset: quantization group size")
    p.add_argument("--cache", default="25%", help="expert cache: bytes or a share of the expert bytes (default 25%%)")
    p.add_argument("--ram", help=argparse.SUPPRESS)
    p.add_argument("--overhead", default="0", help=argparse.SUPPRESS)
    p.add_argument("--disk-gbps", type=float, nargs="+", help="read GB/s of the primary disk, then of each mirror")
    p.add_argument("--mirror-holds", type=float, nargs="+", help="share of the records each mirror holds (default 1)")
    p.add_argument("--memory-gbps", type=float, help="memory bandwidth (default: profile, else measured now)")
    p.add_argument("--compute-gbps", type=float, help="kernels' expert GB/s at batch 1")
    p.add_argument("--compute-gbps-batched", type=float, help="the same at batch 16")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per phase (default 64)")
    p.add_argument("--policy", choices=["lru", "lfu", "learned"], help="cache policy (default: settings cache.policy)")
    p.add_argument("--prefetch-recall", type=float, default=0.0, help="share of experts prefetched in time")
    p.add_argument("--trace", type=Path, help="routing trace (.npz) instead of the synthetic one")
    p.add_argument("--calibrate", type=Path, nargs="+", metavar="E2E_JSON", help="bench e2e --json outputs to "
                   "predict and compare with")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetier.simulate import simulate, synthetic_trace

    if args.calibrate:
        rows = [row for f in args.calibrate for row in calibrate(_load(f))]
        if args.json:
            print(json.dumps({"calibration": rows}))
        else:
            print_calibration(rows)
        return 0
    settings = load_settings(args.config)
    costs, model, what = costs_of(args, settings)
    machine = machine_of(args, settings, costs, model)
    cache = min(resolve_budget(args.cache, costs.expert_bytes), costs.expert_bytes)
    trace, name = None, "synthetic (temporal generator, its defaults; the locality is an assumption)"
    if args.trace is not None:
        from moetier.store.trace import load_trace

        trace, _ = load_trace(args.trace)
        name = f"recorded: {args.trace}"
    if trace is None:
        trace = synthetic_trace(costs, 4 * args.tokens)
    sim = simulate(trace, costs, machine.rates(), capacity=cache // costs.record_bytes,
                   policy=args.policy or settings.cache.policy, tokens=args.tokens, recall=args.prefetch_recall)
    out: dict[str, Any] = {"simulate": what, "cache_bytes": cache, "experts_cached": sim.capacity, "policy": sim.policy,
           "trace": name, "machine": machine.sources,
           **{k: {"tok_s": ph.tok_s, "tok_s_serial": ph.tok_s_serial, "tok_s_expected": ph.tok_s_expected,
                  "hit_rate": ph.hit_rate, "missed_bytes": ph.missed_bytes, "binding": ph.binding}
              for k, ph in (("cold", sim.cold), ("warm", sim.warm))}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"simulate: {what}; cache {cache / 1e9:.2f} GB = {sim.capacity} experts, {sim.policy}; routing: {name}")
        for k in ("cold", "warm"):
            o = out[k]
            print(f"  {k}: {o['tok_s']:.3f} tok/s at the bound ({o['binding']}), {o['tok_s_serial']:.3f} with no "
                  f"overlap; hit rate {o['hit_rate']:.1%}, {o['missed_bytes'] / 1e9:.2f} GB read per token")
    return 0


def _load(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"{path}: not a bench e2e JSON output ({e})") from None
    if not isinstance(obj, dict) or obj.get("name") != "e2e":
        raise InvalidArgument(f"{path}: not a `moetier bench e2e --json` output (no \"name\": \"e2e\")")
    obj["_file"] = str(path)
    return obj


def calibrate(e2e: dict[str, Any], trace: Any = None) -> list[dict[str, Any]]:
    """Prediction beside measurement for one bench e2e run (see the module docstring); `trace`
    replaces the recorded routing of the run's requests (tests)."""
    from moetier.perf import Disk, ModelCosts, Rates
    from moetier.simulate import replay_requests
    from moetier.weights.container import Container

    model = Path(e2e["model"])
    with Container.open(model) as c:
        q = c.quantization
        costs = ModelCosts.of(c.args, model.name, q["experts"], q["dense"], q["group_size"])
    if costs.record_bytes != e2e["record_bytes"]:
        raise InvalidArgument(f"{e2e['_file']}: record bytes {e2e['record_bytes']}, the container at {model} has "
                              f"{costs.record_bytes}: not the model that run used")
    if trace is None:
        from moetier.bench.models import recorded_trace
        from moetier.store.trace import load_trace

        trace, _ = load_trace(recorded_trace(model, e2e["prompt_tokens"], e2e["tokens"]))
    rates = Rates((Disk(e2e["fio_gbps"]["median"]),), e2e["memory_gbps"]["median"])
    rows = []
    for system in ("engine", "cluster"):
        meas = e2e[system]
        recall = meas["cold"]["prefetch_recall"]["median"]
        cold, warm = replay_requests(trace, costs, rates, capacity=e2e["budget_bytes"] // costs.record_bytes,
                                     policy=e2e["policy"], recall=recall)
        for name, ph in (("cold", cold), ("warm", warm)):
            m = meas[name]
            measured = m["s_per_token"]["median"]
            rows.append({"file": e2e["_file"], "budget_bytes": e2e["budget_bytes"], "system": system, "request": name,
                         "measured_s": measured, "bound_s": ph.bound_s, "serial_s": ph.serial_s,
                         "expected_s": ph.expected_s, "measured_bound_s": m["bound_s"]["median"],
                         "measured_hit_rate": m["hit_rate"]["median"], "hit_rate": ph.hit_rate,
                         "error_bound": ph.bound_s / measured - 1, "error_expected": ph.expected_s / measured - 1,
                         "binding": ph.binding})
    return rows


def print_calibration(rows: list[dict[str, Any]]) -> None:
    print(f"{'run':<24} {'cache GB':>8} {'system':<7} {'req':<4} {'measured s':>10} {'bound s':>8} {'err':>6} "
          f"{'expected s':>10} {'err':>6} {'hit meas':>8} {'hit sim':>7}")
    for r in rows:
        print(f"{Path(r['file']).name:<24} {r['budget_bytes'] / 1e9:>8.2f} {r['system']:<7} {r['request']:<4} "
              f"{r['measured_s']:>10.3f} {r['bound_s']:>8.3f} {r['error_bound']:>+6.0%} {r['expected_s']:>10.3f} "
              f"{r['error_expected']:>+6.0%} {r['measured_hit_rate']:>8.1%} {r['hit_rate']:>7.1%}")
    print("bound: max(disk, memory) of the replayed steps (bench e2e's own bound); expected: the reads nobody "
          "prefetched stalling the step (the run's measured recall)")
