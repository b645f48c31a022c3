"""`moetier bench compute`: expert FFN throughput beside the machine's limits.

The figures are GB/s of quantized expert weights (data + scales, the bytes an expert store
holds in RAM) pushed through SwiGLU expert FFNs (gate, up, down) by FastOps at each batch
size, and the GFLOP/s that makes (2 per multiply-add). Their physical limits, measured in
the same run on the same threads and kernel path:
  * memory read bandwidth -- every byte of a large buffer read once with vector loads,
    split between the threads (what a batch-1 expert call does: it streams weights and
    writes almost nothing); a numpy copy is printed beside it for reference (read +
    write bytes counted, single-threaded);
  * FMA peak -- twelve independent fma chains per thread (the batched calls are bound by
    it);
  * the path's own ceiling -- the same calls on one expert whose weights stay in the CPU
    caches: what the kernels do when memory is not what they wait for. Below the memory read
    bandwidth, it is the kernel (its vector operations per weight on this CPU), not memory,
    that bounds batch 1 (`cache ceiling` beside `of memory`).
The peer is ReferenceOps (dequantize, then BLAS).

The working set is many distinct experts laid out as real expert records (default
>= 1 GiB, beyond the CPU caches), so the kernels stream weights from RAM. Weights are
random bytes with sane scales: the speed of these kernels does not depend on values.
Rounds interleave the probes, FastOps and ReferenceOps; the best round of each is
reported (the machine may be shared), with the median beside it. `--backend` takes
several paths (or `every`: each one this CPU runs) and measures each in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetier.bench import models
from moetier.kernels import FastOps, c_paths, warmup
from moetier.kernels.fast import BACKENDS, fma_peak_gflops, read_bandwidth_gbps
from moetier.model.ops import ReferenceOps, silu
from moetier.store.buffers import alloc_aligned
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import ExpertWeights, QDType
from moetier.weights.schema import EXPERTS_ALLOWED


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "compute", help="expert FFN GB/s (FastOps, ReferenceOps) beside measured memory bandwidth")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="rows per expert call (default: 1 16)")
    p.add_argument("--model", help="container directory: use its expert shape, dtype and group size "
                                   f"(default: the benchmark model's, {models.BENCHMARK_PRESET} int4 g64)")
    p.add_argument("--dtype", choices=list(EXPERTS_ALLOWED), default=None,
                   help="expert dtype of the benchmark model's shape (default int4 g64; mxfp4: gpt-oss's "
                        "native experts, e2m1 with one e8m0 scale per 32); not with --model")
    p.add_argument("--working-set-mb", type=int, default=1024, help="distinct expert bytes (default 1024)")
    p.add_argument("--rounds", type=int, default=5, help="measurement rounds (default 5)")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all CPUs)")
    p.add_argument("--backend", nargs="+", default=["auto"], choices=[*BACKENDS, "every"],
                   help="kernel path(s) (default: the best this CPU runs; every: each one it runs)")
    p.add_argument("--activations", choices=["exact", "int8"], default="exact",
                   help="exact (default) or int8 (lossy: the int8-activation kernels)")
    p.add_argument("--ref-experts", type=int, default=12, help="experts per ReferenceOps round (default 12)")
    p.add_argument("--copy-mb", type=int, default=512, help="size of the bandwidth copy (default 512 MiB)")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    dtype: QDType
    group_size: int
    source: str


def preset_shape(preset: str = models.BENCHMARK_PRESET) -> Shape:
    """The routed expert of a synth preset as `benchmark_model` builds it (int4, g64): the
    shape comes from the preset, so the model need not be built for this benchmark."""
    from moetier.convert.synth import preset_args

    a = preset_args(preset)
    return Shape(hidden=a.hidden_size, intermediate=a.moe_intermediate_size, dtype="int4", group_size=64,
                 source=f"default ({preset})")


def _shape(model: str | None, dtype: QDType | None = None) -> Shape:
    if model is None:
        base = preset_shape()
        if dtype is None:
            return base
        return Shape(base.hidden, base.intermediate, dtype, 32 if dtype == "mxfp4" else 64, base.source)
    if dtype is not None:
        raise ValueError("--dtype chooses the benchmark model's expert dtype; a --model brings its own")
    from moetier.weights.container import Container

    c = Container.open(model)
    gate = c.layout.part("gate")
    return Shape(gate.shape[1], gate.shape[0], gate.dtype, gate.group_size, f"container {model}")


def make_experts(shape: Shape, working_set: int, seed: int = 0) -> list[ExpertWeights]:
    """Random experts laid out as real records in one buffer, at least `working_set` bytes."""
    layout = RecordLayout.build(shape.intermediate, shape.hidden, shape.dtype, shape.group_size)
    n = max(2, -(-working_set // layout.used_bytes))
    rng = np.random.default_rng(seed)
    # page-aligned, as the store's record buffers and shared experts are (a numpy buffer of this
    # size starts 16 bytes past a page, so every row began off its cache lines)
    buf = alloc_aligned(n * layout.record_bytes)
    buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
    records = buf.reshape(n, layout.record_bytes)
    for p in layout.parts:
        if p.dtype == "int8":  # q in [-127, 127], as the quantizer writes
            d = records[:, p.data_offset:p.data_offset + p.data_bytes].view(np.int8)
            np.clip(d, -127, 127, out=d)
        elif p.dtype in ("f32", "bf16"):  # finite, modest values
            vals = rng.standard_normal((n, p.shape[0] * p.shape[1]), dtype=np.float32) * 0.02
            raw = vals.view(np.uint32) >> 16 if p.dtype == "bf16" else vals.view(np.uint32)
            dt = np.uint16 if p.dtype == "bf16" else np.uint32
            records[:, p.data_offset:p.data_offset + p.data_bytes] = raw.astype(dt).view(np.uint8)
        if p.scales_offset is not None and p.dtype == "mxfp4":  # e8m0 exponents 2^-9 .. 2^0
            records[:, p.scales_offset:p.scales_offset + p.scales_bytes] = rng.integers(
                118, 128, (n, p.scales_bytes), dtype=np.uint8)
        elif p.scales_offset is not None:
            s = (rng.random((n, p.scales_bytes // 2), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
            records[:, p.scales_offset:p.scales_offset + p.scales_bytes] = s.view(np.uint8)
    return [layout.parse(records[i]) for i in range(n)]


def copy_gbps(src: np.ndarray, dst: np.ndarray) -> float:
    t = time.perf_counter()
    np.copyto(dst, src)
    return 2 * src.nbytes / (time.perf_counter() - t) / 1e9


def _ref_ffn(ref: ReferenceOps, x: np.ndarray, w: ExpertWeights) -> np.ndarray:
    return ref.linear(silu(ref.linear(x, w.gate)) * ref.linear(x, w.up), w.down)


def _backends(names: list[str]) -> list[str]:
    if "every" in names:
        return [name for name, runs in c_paths().items() if runs] or ["numba"]
    return names


def measure(args: argparse.Namespace, backend: str | None = None) -> dict[str, Any]:
    backend = backend or _backends(args.backend)[0]
    shape = _shape(args.model, getattr(args, "dtype", None))
    experts = make_experts(shape, args.working_set_mb << 20)
    per_expert = experts[0].nbytes
    flops_per_row = 2 * 3 * shape.hidden * shape.intermediate  # gate, up, down
    total = per_expert * len(experts)
    warmup(backend)  # type: ignore[arg-type]
    ops = FastOps(backend, threads=args.threads, activations=args.activations)  # type: ignore[arg-type]
    ref = ReferenceOps()
    src = np.ones(max(1, args.copy_mb) << 18, dtype=np.float32)  # copy_mb MiB
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    probes = ops.backend != "numba"
    rng = np.random.default_rng(1)
    xs = {b: rng.standard_normal((b, shape.hidden), dtype=np.float32) for b in args.batch}
    for b in args.batch:  # first touch of every expert, and any lazy set-up
        ops.expert_ffn(xs[b], experts[0])
    nref = max(1, min(args.ref_experts, len(experts)))
    mem: list[float] = []
    read: list[float] = []
    peak: list[float] = []
    fast: dict[int, list[float]] = {b: [] for b in args.batch}
    slow: dict[int, list[float]] = {b: [] for b in args.batch}
    cached: dict[int, list[float]] = {b: [] for b in args.batch}
    for _ in range(max(1, args.rounds)):
        mem.append(copy_gbps(src, dst))
        if probes:
            read.append(read_bandwidth_gbps(ops, src.view(np.uint8), rounds=1))
            peak.append(fma_peak_gflops(ops, seconds=0.2))
        for b in args.batch:
            t = time.perf_counter()
            for w in experts:
                ops.expert_ffn(xs[b], w)
            fast[b].append(total / (time.perf_counter() - t) / 1e9)
        for b in args.batch:  # one expert, as many calls: its weights stay in cache after the first
            ops.expert_ffn(xs[b], experts[0])
            t = time.perf_counter()
            for _ in experts:
                ops.expert_ffn(xs[b], experts[0])
            cached[b].append(total / (time.perf_counter() - t) / 1e9)
        for b in args.batch:
            t = time.perf_counter()
            for w in experts[:nref]:
                _ref_ffn(ref, xs[b], w)
            slow[b].append(nref * per_expert / (time.perf_counter() - t) / 1e9)
    mem_best = max(mem)
    read_best = max(read) if read else None
    peak_best = max(peak) if peak else None
    bound = read_best or mem_best

    def gflops(gbps: float, b: int) -> float:
        return gbps * 1e9 / per_expert * b * flops_per_row / 1e9

    batches = {
        str(b): {
            "fast_gbps": max(fast[b]),
            "fast_gbps_median": statistics.median(fast[b]),
            "fast_ms_per_expert": per_expert / max(fast[b]) / 1e6,
            "fast_gflops": gflops(max(fast[b]), b),
            "cached_gbps": max(cached[b]),
            "cached_gbps_median": statistics.median(cached[b]),
            "cache_ceiling_of_memory": max(cached[b]) / bound,
            "reference_gbps": max(slow[b]),
            "reference_gbps_median": statistics.median(slow[b]),
            "fraction_of_memory": max(fast[b]) / bound,
            "fraction_of_copy": max(fast[b]) / mem_best,
            "fraction_of_fma_peak": gflops(max(fast[b]), b) / peak_best if peak_best else None,
            "speedup_vs_reference": max(fast[b]) / max(slow[b]),
        }
        for b in args.batch
    }
    return {
        "benchmark": "compute",
        "backend": ops.backend,
        "activations": ops.activations,
        "threads": ops.threads,
        "expert": {"hidden": shape.hidden, "intermediate": shape.intermediate, "dtype": shape.dtype,
                   "group_size": shape.group_size, "bytes": per_expert, "source": shape.source},
        "experts": len(experts),
        "working_set_bytes": total,
        "reference_experts": nref,
        "rounds": max(1, args.rounds),
        "memory_gbps": bound,
        "memory_method": (f"vector reads of {src.nbytes >> 20} MiB on {ops.threads} threads ({ops.backend})"
                          if read_best else f"numpy copy of {src.nbytes >> 20} MiB (no C probe on {ops.backend})"),
        "read_gbps": read_best,
        "read_gbps_median": statistics.median(read) if read else None,
        "copy_gbps": mem_best,
        "copy_gbps_median": statistics.median(mem),
        "copy_method": f"numpy copy of {src.nbytes >> 20} MiB float32, read + write bytes (2 x size), one thread",
        "fma_peak_gflops": peak_best,
        "fma_peak_gflops_median": statistics.median(peak) if peak else None,
        "fma_peak_method": f"twelve independent fma chains per thread, {ops.threads} threads ({ops.backend})",
        "batch": batches,
        "ratio": batches["1"]["fraction_of_memory"] if "1" in batches else None,
    }


def _print(r: dict[str, Any]) -> None:
    e = r["expert"]
    g = f" g{e['group_size']}" if e["group_size"] else ""
    lossy = " (LOSSY: int8 activations)" if r["activations"] == "int8" else ""
    print(f"expert: {e['dtype']}{g}, D={e['hidden']} I={e['intermediate']}, {e['bytes'] / 1e6:.2f} MB "
          f"(data + scales) [{e['source']}]")
    print(f"working set: {r['experts']} distinct experts, {r['working_set_bytes'] / 2**20:.0f} MiB; "
          f"FastOps backend {r['backend']}{lossy}, threads={r['threads']}; best of {r['rounds']} rounds (median)")
    if r["read_gbps"]:
        print(f"memory read bandwidth: {r['read_gbps']:.1f} GB/s ({r['read_gbps_median']:.1f}) -- {r['memory_method']}")
    print(f"memory copy: {r['copy_gbps']:.1f} GB/s ({r['copy_gbps_median']:.1f}) -- {r['copy_method']}")
    if r["fma_peak_gflops"]:
        print(f"FMA peak: {r['fma_peak_gflops']:.1f} GFLOP/s ({r['fma_peak_gflops_median']:.1f}) -- "
              f"{r['fma_peak_method']}")
    print(f"{'batch':>5}  {'FastOps GB/s':>18}  {'of memory':>9}  {'GFLOP/s':>8}  {'of FMA peak':>11}  "
          f"{'ms/expert':>9}  {'in cache GB/s':>13}  {'cache ceiling':>13}  {'ReferenceOps GB/s':>18}  "
          f"{'speed-up':>8}")
    for b, v in r["batch"].items():
        peak = f"{v['fraction_of_fma_peak']:>10.0%}" if v["fraction_of_fma_peak"] is not None else f"{'-':>10}"
        print(f"{b:>5}  {v['fast_gbps']:>7.2f} ({v['fast_gbps_median']:>7.2f})  {v['fraction_of_memory']:>8.0%}  "
              f"{v['fast_gflops']:>8.1f}  {peak}   {v['fast_ms_per_expert']:>9.3f}  "
              f"{v['cached_gbps']:>13.2f}  {v['cache_ceiling_of_memory']:>12.0%}  "
              f"{v['reference_gbps']:>7.2f} ({v['reference_gbps_median']:>7.2f})  {v['speedup_vs_reference']:>7.1f}x")
    print(f"ReferenceOps runs {r['reference_experts']} experts per round (dequantize + BLAS is compute-bound).")
    print("in cache: the same calls on one expert whose weights stay in the CPU caches, the path's own "
          "ceiling; a cache ceiling under 100% of memory means the kernel, not memory, bounds that batch.")


def run(args: argparse.Namespace) -> int:
    if any(b < 1 for b in args.batch):
        raise SystemExit("moetier bench compute: --batch values must be >= 1")
    results = [measure(args, b) for b in _backends(args.backend)]
    if args.json:
        out = dict(results[0])
        if len(results) > 1:
            out["backends"] = results
        print(json.dumps(out))
        return 0
    for i, r in enumerate(results):
        if i:
            print()
        _print(r)
    return 0
