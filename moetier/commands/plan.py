"""`moetier plan`: where a model goes on a machine (RAM tiers, disks) and how fast it will decode.

    moetier plan --preset glm-5 --ram 25GB --disk-gbps 1
    moetier plan --model DIR                       # this machine: its RAM, its disk, its kernels
    moetier plan --preset glm-5 --ram 128GB --disk-gbps 9 3   # a primary and a full mirror

Figures the plan needs and is not given come from the profile `moetier tune` saved, else are
measured now (memory bandwidth, the kernels at the model's record shape, the model's disk with
--model); each is printed with where it came from. The prediction is the simulator's
(moetier/simulate.py) over a routing trace at the model's shape, each step timed by the
performance model the benchmarks use (moetier/perf.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetier.errors import InvalidArgument
from moetier.settings import Settings, load_settings, parse_bytes

if TYPE_CHECKING:  # the modules themselves load when the command runs (every `moetier` call builds the parser)
    from moetier.perf import ModelCosts
    from moetier.planner import Machine, Plan
    from moetier.weights.quant import QDType

DEFAULT_OVERHEAD = "2GiB"  # the OS and the four services' interpreters at rest (printed; --overhead sets it)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "plan", help="placement of a model on a machine and its predicted decode tok/s and TTFT")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", type=Path, help="container directory (default: settings model.path)")
    what.add_argument("--preset", help="a synth preset's shape instead of a container (e.g. glm-5)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--experts", default="int4", choices=["int4", "int8", "bf16", "f32"], help="preset: experts")
    p.add_argument("--dense", default="int8", choices=["int4", "int8", "bf16", "f32"], help="preset: dense")
    p.add_argument("--group-size", type=int, default=64, help="preset: quantization group size")
    p.add_argument("--ram", help="RAM (e.g. 25GB; default: this machine's)")
    p.add_argument("--overhead", default=DEFAULT_OVERHEAD, help=f"RAM the caches never get (default {DEFAULT_OVERHEAD})")
    p.add_argument("--disk-gbps", type=float, nargs="+", help="read GB/s of the primary disk, then of each mirror")
    p.add_argument("--mirror-holds", type=float, nargs="+", help="share of the records each mirror holds (default 1)")
    p.add_argument("--memory-gbps", type=float, help="memory bandwidth (default: profile, else measured now)")
    p.add_argument("--compute-gbps", type=float, help="kernels' expert GB/s at batch 1 (default: profile, else "
                   "measured now)")
    p.add_argument("--compute-gbps-batched", type=float, help="the same at the prefill batch (moetier.planner.PREFILL_ROWS rows)")
    p.add_argument("--context", type=int, default=4096, help="tokens of KV to keep room for (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences sharing the KV budget (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per simulated phase (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt of the TTFT prediction (default 1000)")
    p.add_argument("--policy", choices=["lru", "lfu", "learned"], help="cache policy (default: settings cache.policy)")
    p.add_argument("--prefetch-recall", type=float, default=0.0,
                   help="share of a layer's experts prefetched in time (bench e2e measures it; default 0)")
    p.add_argument("--trace", type=Path, help="routing trace (.npz) to replay instead of the synthetic one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def costs_of(args: argparse.Namespace, settings: Settings) -> tuple[ModelCosts, Path | None, str]:
    """(the model's byte counts, its container directory or None, a description)."""
    from moetier.perf import ModelCosts

    if args.preset:
        from moetier.convert.synth import PRESETS, preset_args

        if args.preset not in PRESETS:
            raise InvalidArgument(f"unknown preset {args.preset!r}; `moetier synth --list` names them")
        ex: QDType = args.experts
        de: QDType = args.dense
        return (ModelCosts.of(preset_args(args.preset), args.preset, ex, de, args.group_size), None,
                f"preset {args.preset}, {ex} experts g{args.group_size}, {de} dense")
    path = args.model or settings.model.path
    if path is None:
        raise InvalidArgument("give --model DIR or --preset NAME (or set model.path)")
    from moetier.weights.container import Container

    with Container.open(path) as c:
        q = c.quantization
        costs = ModelCosts.of(c.args, Path(path).name, q["experts"], q["dense"], q["group_size"])
    return costs, Path(path), f"container {path}, {q['experts']} experts g{q['group_size']}, {q['dense']} dense"


def machine_of(args: argparse.Namespace, settings: Settings, costs: ModelCosts, model: Path | None) -> Machine:
    from moetier import probe
    from moetier.perf import Disk
    from moetier.planner import PREFILL_ROWS, Machine
    from moetier.profile import load_profile

    prof = load_profile(settings)
    src: dict[str, str] = {}
    ram = parse_bytes(args.ram) if args.ram else _mem_total()
    src["ram"] = "given" if args.ram else "this machine (/proc/meminfo)"
    if args.disk_gbps:
        rates, src["disks"] = list(args.disk_gbps), "given"
    elif prof is not None and prof.disk_gbps:
        rates, src["disks"] = [prof.disk_gbps], "profile (moetier tune)"
    elif model is not None:
        from moetier.weights.index import ExpertIndex

        r = probe.disk_gbps(ExpertIndex.load(model), settings.storage.queue_depth, seconds=3.0)
        rates = [r.gbps]
        src["disks"] = f"measured now: 3 s of random {'O_DIRECT' if r.direct else 'buffered'} reads, depth {r.depth}"
    else:
        raise InvalidArgument("give --disk-gbps (a preset has no disk here to measure; or run `moetier tune`)")
    holds = list(args.mirror_holds or [])
    if len(holds) > len(rates) - 1:
        raise InvalidArgument(f"--mirror-holds gives {len(holds)} shares for {len(rates) - 1} mirrors")
    holds += [1.0] * (len(rates) - 1 - len(holds))
    disks = (Disk(rates[0]), *(Disk(g, h) for g, h in zip(rates[1:], holds, strict=True)))
    mem = args.memory_gbps or (prof.memory_gbps if prof else None)
    src["memory"] = "given" if args.memory_gbps else "profile (moetier tune)" if mem else "measured now (numpy copy)"
    if mem is None:
        mem = probe.memory_gbps()
    b1, b16 = args.compute_gbps, args.compute_gbps_batched
    if b1 is None and prof is not None:
        b1, b16 = prof.compute_gbps, b16 or prof.compute_gbps_batched
        src["compute"] = "profile (moetier tune)"
    if b1 is None or b16 is None:
        layout = probe.record_layout(*_expert_shape(args, model))
        experts = probe.random_experts(layout.parts[0].shape[1], layout.parts[0].shape[0], layout.parts[0].dtype,
                                       layout.parts[0].group_size, max(64 << 20, 4 * layout.used_bytes))
        r1 = probe.kernel_gbps(experts, 1, 1.0)
        r16 = probe.kernel_gbps(experts, PREFILL_ROWS, 1.0)
        b1 = b1 or r1.gbps
        b16 = b16 or r16.gbps
        src["compute"] = f"measured now on this machine ({r1.backend}, {r1.threads} threads)"
    else:
        src.setdefault("compute", "given")
    return Machine(ram, parse_bytes(args.overhead), disks, mem, b1, b16, src)


def _expert_shape(args: argparse.Namespace, model: Path | None) -> tuple[int, int, QDType, int]:
    if model is not None:
        from moetier.weights.container import Container

        with Container.open(model) as c:
            return c.args.hidden_size, c.args.moe_intermediate_size, c.quantization["experts"], c.quantization[
                "group_size"]
    from moetier.convert.synth import preset_args

    a = preset_args(args.preset)
    return a.hidden_size, a.moe_intermediate_size, args.experts, args.group_size


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run(args: argparse.Namespace) -> int:
    from moetier.planner import plan

    if min(args.context, args.batch, args.tokens, args.prompt_tokens) < 1:
        raise InvalidArgument("--context, --batch, --tokens and --prompt-tokens must be >= 1")
    settings = load_settings(args.config)
    costs, model, what = costs_of(args, settings)
    machine = machine_of(args, settings, costs, model)
    trace = None
    name = ""
    if args.trace is not None:
        from moetier.store.trace import load_trace

        trace, n = load_trace(args.trace)
        layers = {layer for step in trace for layer, _ in step}
        if n != costs.n_experts or len(layers) != costs.moe_layers:
            raise InvalidArgument(f"{args.trace}: a trace of {len(layers)} MoE layers x {n} experts; the model has "
                                  f"{costs.moe_layers} x {costs.n_experts}")
        name = f"recorded: {args.trace}"
    p = plan(costs, machine, context=args.context, batch=args.batch, tokens=args.tokens,
             prompt_tokens=args.prompt_tokens, policy=args.policy or settings.cache.policy,
             recall=args.prefetch_recall, trace=trace, trace_name=name)
    out = {"plan": what, **p.to_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        print_plan(what, p)
    return 0 if p.placement.fits else 1


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def print_plan(what: str, p: Plan, out: Any = None) -> None:
    from moetier.planner import PREFILL_ROWS

    out = out or sys.stdout  # looked up now: a redirected stdout counts
    m, pl, c = p.machine, p.placement, p.costs
    w = out.write
    w(f"plan: {what}, on {_gb(m.ram_bytes)} of RAM\n")
    disks = " + ".join(f"{d.gbps:.2f} GB/s" + ("" if i == 0 else f" (mirror, {d.holds:.0%} of the records)")
                       for i, d in enumerate(m.disks))
    w(f"machine: disks {disks} [{m.sources['disks']}]; memory {m.memory_gbps:.1f} GB/s [{m.sources['memory']}]; "
      f"kernels {m.compute_gbps or 0:.2f} GB/s at batch 1, {m.compute_gbps_batched or 0:.2f} at batch "
      f"{PREFILL_ROWS} [{m.sources['compute']}]\n")
    w("placement:\n")
    w(f"  fixed overhead       {_gb(m.overhead_bytes):>12}\n")
    w(f"  dense (resident)     {_gb(pl.dense_bytes):>12}\n")
    w(f"  KV ({pl.context} tokens x {pl.batch}) {_gb(pl.kv_bytes):>12}\n")
    w(f"  expert cache         {_gb(pl.expert_cache_bytes):>12} = {pl.experts_cached} of "
      f"{c.moe_layers * c.n_experts} experts, {pl.cache_fraction:.1%} of {_gb(c.expert_bytes)}\n")
    for i, held in enumerate(pl.disk_bytes):
        w(f"  disk {i} ({'primary' if i == 0 else 'mirror'}){'':7}{_gb(held):>12} of expert records\n")
    if not pl.fits:
        short = m.overhead_bytes + pl.dense_bytes + pl.kv_bytes + c.record_bytes - m.ram_bytes
        w(f"does not fit: the dense part, the KV and one expert need {_gb(short)} more RAM "
          "(a smaller --context, int4 dense weights or more RAM)\n")
    sim = p.simulation
    if sim is not None:
        w(f"prediction (batch 1, {sim.policy} cache, prefetch recall {sim.recall:.0%}; per token):\n")
        for name, ph in (("cold", sim.cold), ("warm", sim.warm)):
            w(f"  {name}: {ph.tok_s:.3f} tok/s at the bound ({ph.binding}), {ph.tok_s_serial:.3f} with no overlap, "
              f"{ph.tok_s_expected:.3f} expected; hit rate {ph.hit_rate:.1%}, {_gb(ph.missed_bytes)} read, "
              f"{_gb(ph.touched_bytes)} touched (disk {ph.disk_s:.3f} s, memory {ph.memory_s:.3f} s, "
              f"compute {ph.compute_s:.3f} s)\n")
    w(f"  TTFT of a {p.prompt_tokens}-token prompt, cold: {p.ttft_s:.2f} s ({p.ttft_binding})\n")
    w(f"routing: {p.trace}\n")
