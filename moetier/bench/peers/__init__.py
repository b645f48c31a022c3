"""`moetier bench peers`: moetier beside llama.cpp, on the same checkpoint, behind their OpenAI servers.

    moetier bench peers --install      # once: builds llama-cpp-python from its sdist (see peer.py)
    moetier bench peers [--json]       # both precisions, both regimes, 3 rounds

The model is `moetier synth --preset olmoe-1b-7b --format hf` (seed 0), converted for each
system by its own tools at matched precision (inputs.py). Both systems are servers started
as their users start them (`moetier up`; llama_cpp.server), 2 threads each (llama.cpp's
--n_threads; every process of both pinned to the same CPUs), timed by one client (client.py),
in alternating rounds of fresh starts (run.py). Two regimes:

  * resident: the whole model in RAM: llama.cpp with its CPU repack (its default) and with
    the weights left mmapped; moetier with an expert cache of 100%;
  * capped: each system's process tree in a v1 memory cgroup with the same limit (default
    40% of the GGUF's bytes + 640 MiB for the runtime), page cache charged, the page cache
    dropped before each start; llama.cpp with its weights mmapped (the repack would copy
    them into anonymous memory, which cannot fit), at the disk's read-ahead and, where run
    as root, at 128 KiB (the setting restored afterwards); moetier with the expert cache
    that leaves room for its own footprint (measured by a start with a 1% cache) + headroom
    (by default the KV cache of the longest request + HEADROOM_BUFFERS).

Printed per block: TTFT, TTFT of the same prompt again, decode tok/s, prefill tok/s of a
~1k-token prompt (min/median/max over rounds), CPU cores busy during decode, peak memory,
disk bytes read per request, each moetier process's baseline RSS, the ratios moetier /
llama.cpp, and whether every system wrote the same greedy text. `--in-process` replaces
`moetier up` with the in-process engine. docs/benchmarks.md explains each figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetier.bench.peers import inputs, report, run
from moetier.bench.peers.inputs import PRECISIONS, Precision
from moetier.bench.peers.peer import LLAMA_CPP_PYTHON, Peer, install, require_peer
from moetier.bench.peers.sandbox import (
    CGROUP_PREFIX,
    Cgroup,
    ReadAhead,
    block_device,
    cgroup_v1_available,
    sigterm_as_interrupt,
)
from moetier.bench.peers.systems import LlamaCpp, MoetierInProcess, MoetierUp, System
from moetier.errors import InvalidArgument
from moetier.settings import load_settings, parse_bytes

HEADROOM_BUFFERS = 64 << 20  # capped moetier's default headroom beside the KV of its longest request

REGIMES = ("resident", "capped")
LOW_READ_AHEAD_KB = 128
FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile",
         "asimd", "sve")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "peers", help="moetier beside llama.cpp (built from source) on the same checkpoint: TTFT, decode and "
                      "prefill tok/s, memory, disk, CPU; all-resident and memory-capped")
    p.add_argument("--install", action="store_true", help="build llama-cpp-python from its sdist into "
                   "data_dir/peers (once) and exit")
    p.add_argument("--plan", action="store_true", help="print what would run (blocks, systems, caps) and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the peer and models live)")
    p.add_argument("--precision", default="q4,q8", help="comma list of q4 (int4 vs Q4_0), q8 (int8 vs Q8_0) "
                   "(default q4,q8)")
    p.add_argument("--regime", default="resident,capped", help="comma list of resident, capped (default both)")
    p.add_argument("--rounds", type=int, default=3, help="fresh starts of each system per block (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads (CPUs) of each system (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=30, help="prompt of the decode requests (default 30)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode request (default 64)")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="prompt of the prefill request (default 1024)")
    p.add_argument("--in-process", action="store_true", help="moetier's in-process engine instead of `moetier up`")
    p.add_argument("--activations", choices=["exact", "int8"], default="exact",
                   help="moetier's kernels: exact (default) or int8 (LOSSY: the int8-activation mode, "
                   "kernels.activations, named in each of its rows)")
    p.add_argument("--cap", help="memory limit of the capped regime (bytes, e.g. 2.2GB; default: --cap-share "
                   "of the GGUF's bytes + --runtime)")
    p.add_argument("--cap-share", type=float, default=0.40, help="share of the model's bytes (default 0.40)")
    p.add_argument("--runtime", default="640MiB", help="allowance for the runtime itself in the default cap "
                   "(default 640MiB)")
    p.add_argument("--headroom", help="capped moetier: memory left free beside its footprint and expert "
                   "cache (default: the float32 KV cache of the longest request, --prefill-tokens + --tokens, "
                   f"+ {HEADROOM_BUFFERS >> 20} MiB for buffers and page cache)")
    p.add_argument("--capped-expert-cache", help="capped moetier's expert cache (default: cap - footprint - "
                   "headroom)")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help=f"version (default {LLAMA_CPP_PYTHON})")
    p.add_argument("--keep-bf16-gguf", action="store_true", help="keep the intermediate bf16 GGUF")
    p.set_defaults(func=main)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise InvalidArgument(f"{flag} {text!r}: choose from {', '.join(allowed)} (comma-separated)")
    return list(dict.fromkeys(got))


def check_args(args: argparse.Namespace) -> None:
    for name, least in (("rounds", 1), ("threads", 1), ("prompt_tokens", 1), ("tokens", 2), ("prefill_tokens", 16)):
        if getattr(args, name) < least:
            raise InvalidArgument(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {least}")
    cpus = len(os.sched_getaffinity(0))
    if args.threads > cpus:
        raise InvalidArgument(f"--threads {args.threads}: this process may use only {cpus} CPUs")
    if not 0 < args.cap_share < 1:
        raise InvalidArgument(f"--cap-share {args.cap_share}: must be between 0 and 1")
    for flag in ("cap", "runtime", "headroom", "capped_expert_cache"):
        value = getattr(args, flag)
        if value is not None:
            parse_bytes(value)


def say_to(stream: Any) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    return say


def main(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    data = settings.data_path
    say = say_to(sys.stderr if args.json else sys.stdout)
    if args.install:
        t0 = time.perf_counter()
        peer = install(data, args.llama_cpp_python, say=say)
        rec = peer.record
        say(f"llama-cpp-python {rec['version']} at {peer.root}: built in {rec['seconds']['build']:.0f} s "
            f"({time.perf_counter() - t0:.0f} s this call)\n  {rec['system_info']}")
        return 0
    check_args(args)
    precisions = [PRECISIONS[p] for p in _choices(args.precision, tuple(PRECISIONS), "--precision")]
    regimes = _choices(args.regime, REGIMES, "--regime")
    note = data / "peers" / "read_ahead.restore.json"
    ReadAhead.restore_leftover(note, say)
    no_cgroup = cgroup_v1_available()
    if not no_cgroup:
        Cgroup.remove_leftovers(CGROUP_PREFIX, say=say)
    if "capped" in regimes and no_cgroup:
        say(f"capped regime skipped: {no_cgroup}")
        regimes = [r for r in regimes if r != "capped"]
    if args.plan:
        (data / "peers").mkdir(parents=True, exist_ok=True)
        dev = block_device(data / "peers")
        ra_kb = int((dev / "queue" / "read_ahead_kb").read_text()) if dev is not None else None
        for block in plan_blocks(args, precisions, regimes, None, {}, ra_kb, root=os.geteuid() == 0):
            print(f"{block.precision} {block.regime}: " + "; ".join(r.label for r in block.rows)
                  + (f" (cap {block.cap_bytes / 1e9:.2f} GB)" if block.cap_bytes else ""))
        return 0
    peer = require_peer(data, args.llama_cpp_python)
    with sigterm_as_interrupt():
        result = measure(args, data, peer, precisions, regimes, use_cgroups=no_cgroup is None, note=note, say=say)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print()
        print(machine_line(result["machine"], result["llama_cpp"]))
        for block in result["blocks"]:
            print()
            print(report.table(block))
    return 0


def machine_info(model_path: Path) -> dict[str, Any]:
    flags: set[str] = set()
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("flags", "Features") and not flags:
                flags = set(v.split())
            if k.strip() == "model name":
                name = v.strip()
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(OSError, IndexError, ValueError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    dev = block_device(model_path)
    from moetier.kernels.fast import FastOps

    return {"cpu": name, "cpus": os.cpu_count(), "flags": sorted(f for f in FLAGS if f in flags),
            "memory_bytes": mem, "kernel": platform.release(), "moetier_kernels": FastOps(threads=1).backend,
            "disk": dev.name if dev else None,
            "read_ahead_kb": int((dev / "queue" / "read_ahead_kb").read_text()) if dev else None}


def machine_line(m: dict[str, Any], peer: dict[str, Any]) -> str:
    return (f"machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_bytes'] / 2**30:.0f} GiB, flags "
            f"{' '.join(m['flags'])}; moetier kernels {m['moetier_kernels']}; disk {m['disk']} read_ahead_kb "
            f"{m['read_ahead_kb']}\nllama.cpp: llama-cpp-python {peer['version']} ({peer['cmake_args']}"
            f"{', CFLAGS ' + peer['cflags'] if peer.get('cflags') else ''}, built in "
            f"{peer['seconds']['build']:.0f} s): {peer['system_info']}")


def model_bytes_estimate(p: Precision) -> int:
    """GGUF bytes of the preset before it exists: weights x (bits per weight of the type)."""
    from moetier.convert.synth import describe, preset_args

    d, a = describe(inputs.PRESET), preset_args(inputs.PRESET)
    params = d["dense_params"] + len(a.moe_layer_ids) * a.n_routed_experts * 3 * a.moe_intermediate_size * a.hidden_size
    return int(params * (4.5 if p.gguf_type == "Q4_0" else 8.5) / 8)


def headroom_bytes(args: argparse.Namespace) -> int:
    """What capped moetier needs beside its footprint and expert cache: --headroom, or the KV
    cache of the longest request (float32, every layer) + HEADROOM_BUFFERS. Measured (OLMoE q4,
    `moetier up` capped at 2.23 GB): the dense worker grows by its request's KV during a 1k-token
    prefill, the expert store by about 30 MB beside its cache."""
    if args.headroom is not None:
        return parse_bytes(args.headroom)
    from moetier.convert.synth import preset_args

    kv = 4 * preset_args(inputs.PRESET).kv_floats_per_token * (args.prefill_tokens + args.tokens)
    return kv + HEADROOM_BUFFERS


def cap_for(args: argparse.Namespace, model_bytes: int) -> int:
    if args.cap is not None:
        return parse_bytes(args.cap)
    return int(args.cap_share * model_bytes + parse_bytes(args.runtime))


def plan_blocks(args: argparse.Namespace, precisions: list[Precision], regimes: list[str], peer: Peer | None,
                paths: dict[str, dict[str, Path]], read_ahead_kb: int | None, *, root: bool,
                expert_cache: Callable[[Precision, int], str] | None = None) -> list[run.Block]:
    """The blocks to run. `paths[precision]` holds "gguf" and "container" once they exist."""
    blocks = []
    moetier_label = "moetier (in-process engine)" if args.in_process else "moetier (moetier up)"
    if args.activations == "int8":
        moetier_label += ", int8 activations (LOSSY)"
    n_ctx = max(2048, -(-(args.prefill_tokens + args.tokens + 64) // 256) * 256)

    def llama(p: Precision, repack: bool) -> Callable[[Path], System]:
        def make(work: Path) -> System:
            return LlamaCpp(label="", kind="llama.cpp", work=work, peer=peer, gguf=paths[p.name]["gguf"],
                            threads=args.threads, n_ctx=n_ctx, repack=repack)
        return make

    def moetier(p: Precision, cache: str) -> Callable[[Path], System]:
        cls = MoetierInProcess if args.in_process else MoetierUp

        def make(work: Path) -> System:
            return cls(label=moetier_label, kind="moetier", work=work, model=paths[p.name]["container"],
                       expert_cache=cache, activations=args.activations)
        return make

    for p in precisions:
        gguf_path = paths.get(p.name, {}).get("gguf")
        model_bytes = gguf_path.stat().st_size if gguf_path is not None else model_bytes_estimate(p)
        for regime in regimes:
            if regime == "resident":
                rows = [run.Row("llama.cpp", llama(p, True)),
                        run.Row("llama.cpp, weights mmapped (no repack)", llama(p, False)),
                        run.Row(moetier_label, moetier(p, "100%"))]
                blocks.append(run.Block(p.name, regime, rows))
                continue
            cap = cap_for(args, model_bytes)
            ra = f"{read_ahead_kb} KiB" if read_ahead_kb is not None else "the machine's"
            rows = [run.Row(f"llama.cpp, mmapped, read-ahead {ra}", llama(p, False))]
            notes = []
            if read_ahead_kb is None:
                notes.append("the model's disk has no read_ahead_kb (no block device): one llama.cpp row only")
            elif not root:
                notes.append(f"not root: llama.cpp runs at the machine's read-ahead only ({read_ahead_kb} KiB)")
            elif read_ahead_kb != LOW_READ_AHEAD_KB:
                rows.append(run.Row(f"llama.cpp, mmapped, read-ahead {LOW_READ_AHEAD_KB} KiB", llama(p, False),
                                    read_ahead_kb=LOW_READ_AHEAD_KB))
            cache = expert_cache(p, cap) if expert_cache is not None else "(cap - footprint - headroom)"
            rows.append(run.Row(f"{moetier_label}, expert cache {cache}", moetier(p, cache)))
            blocks.append(run.Block(p.name, regime, rows, cap_bytes=cap, notes=notes))
    return blocks


def measure(args: argparse.Namespace, data: Path, peer: Peer, precisions: list[Precision], regimes: list[str],
            *, use_cgroups: bool, note: Path, say: Callable[[str], None]) -> dict[str, Any]:
    hf = inputs.hf_checkpoint(data, say)
    paths: dict[str, dict[str, Path]] = {}
    for p in precisions:
        paths[p.name] = {"container": inputs.container(data, hf, p, say),
                         "gguf": inputs.gguf(data, hf, peer, p, say=say)}
    if not args.keep_bf16_gguf:
        inputs.drop_intermediate(data, peer, precisions)
    first = paths[precisions[0].name]["container"]
    machine = machine_info(first)
    dev = block_device(first)
    ra = ReadAhead(dev, note) if dev is not None and os.geteuid() == 0 else None
    prompts, tokenization = make_prompts(args, first, paths[precisions[0].name]["gguf"], peer)
    if not tokenization["same_tokens"]:
        say("WARNING: llama.cpp tokenizes the prompts differently from moetier: " + json.dumps(tokenization))
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    work = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=data / "peers"))
    footprints: dict[str, dict[str, int]] = {}

    def expert_cache(p: Precision, cap: int) -> str:
        if args.capped_expert_cache is not None:
            return str(args.capped_expert_cache)
        fp = footprints.setdefault(p.name, run.moetier_footprint(paths[p.name]["container"], work / f"probe-{p.name}",
                                                                 cpus, args.in_process))
        room = headroom_bytes(args)
        cache = cap - sum(fp.values()) - room
        if cache <= 0:
            raise InvalidArgument(f"cap {cap / 1e9:.2f} GB leaves no expert cache for moetier: its footprint is "
                                  f"{sum(fp.values()) / 1e9:.2f} GB + headroom {room / 2**20:.0f} MiB; give --cap")
        return f"{cache / 2**30:.2f}GiB"

    blocks_out = []
    try:
        blocks = plan_blocks(args, precisions, regimes, peer, paths, machine["read_ahead_kb"],
                             root=os.geteuid() == 0, expert_cache=expert_cache)
        for block in blocks:
            results = run.run_block(block, args.rounds, prompts, work, cpus=cpus, tokens=args.tokens,
                                    use_cgroups=use_cgroups, ra=ra, say=say)
            blocks_out.append(block_result(block, results, footprints.get(block.precision)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headline = [{"precision": b["precision"], "regime": b["regime"], **r} for b in blocks_out for r in b["ratios"]]
    return {
        "benchmark": "peers",
        # decode tok/s moetier / llama.cpp of the first block (q4 resident by default), then every ratio
        "ratio": headline[0]["decode"] if headline else None,
        "ratios": headline,
        "machine": machine,
        "llama_cpp": peer.record,
        "settings": {"rounds": args.rounds, "threads": args.threads, "cpus": cpus, "prompt_tokens": args.prompt_tokens,
                     "tokens": args.tokens, "prefill_tokens": args.prefill_tokens, "in_process": args.in_process,
                     "activations": args.activations,
                     "cgroups": use_cgroups, "model": f"synth {inputs.PRESET} seed {inputs.SEED}"},
        "models": {p.name: {"describe": p.describe(), "gguf": inputs.gguf_summary(paths[p.name]["gguf"]),
                            "container": inputs.container_summary(paths[p.name]["container"])} for p in precisions},
        "tokenization": tokenization,
        "blocks": blocks_out,
    }


def block_result(block: run.Block, results: dict[str, list[dict[str, Any]]],
                 footprint: dict[str, int] | None) -> dict[str, Any]:
    systems: dict[str, dict[str, Any]] = {label: {"trials": trials, "summary": report.summarize(trials)}
                                          for label, trials in results.items()}
    moetier_rows = [r.label for r in block.rows if r.label.startswith("moetier")]
    ratios = []
    for m in moetier_rows:
        for other in (r.label for r in block.rows if r.label.startswith("llama.cpp")):
            a, b = systems[m]["summary"], systems[other]["summary"]
            ratios.append({"system": m, "against": other, "decode": report.ratio(a["decode_tok_s"], b["decode_tok_s"]),
                           "prefill": report.ratio(a["prefill_tok_s"], b["prefill_tok_s"]),
                           "ttft": report.ratio(a["ttft_s"], b["ttft_s"])})
    return {"precision": block.precision, "regime": block.regime, "describe": PRECISIONS[block.precision].describe(),
            "cap_bytes": block.cap_bytes, "moetier_footprint_rss": footprint, "notes": block.notes,
            "systems": systems, "ratios": ratios, "text_check": report.text_check(results)}


def make_prompts(args: argparse.Namespace, container: Path, gguf: Path, peer: Peer) -> tuple[run.Prompts, dict[str, Any]]:
    """Prompts of exact token counts cut from the shipped text, and whether llama.cpp's
    tokenizer gives the same tokens as moetier's for each."""
    from moetier.bench.models import prompt_ids
    from moetier.text.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(container)
    texts = {"decode": tok.decode(prompt_ids(tok, args.prompt_tokens, 0)),
             "prefill": tok.decode(prompt_ids(tok, args.prefill_tokens, 1)),
             "warmup": tok.decode(prompt_ids(tok, args.prefill_tokens, 2))}
    ours = {k: tok.encode(v, add_special_tokens=True) for k, v in texts.items()}
    r = subprocess.run(peer.script("gguf_tokenize.py", str(gguf)), input=json.dumps(list(texts.values())),
                       capture_output=True, text=True, check=False)
    theirs = dict(zip(texts, json.loads(r.stdout), strict=True)) if r.returncode == 0 else {}
    tokenization = {"same_tokens": bool(theirs) and all(theirs[k] == ours[k] for k in texts),
                    "moetier_tokens": {k: len(v) for k, v in ours.items()},
                    "llama_cpp_tokens": {k: len(v) for k, v in theirs.items()},
                    "error": None if r.returncode == 0 else r.stderr[-1000:]}
    prompts = run.Prompts(decode=texts["decode"], warmup=texts["warmup"], prefill=[texts["prefill"]],
                          token_counts={"prefill0": len(ours["prefill"]), "decode": len(ours["decode"])})
    return prompts, tokenization
