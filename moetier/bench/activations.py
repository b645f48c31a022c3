"""`moetier bench activations`: what the opt-in int8-activation mode costs in accuracy, per architecture.

`kernels.activations: int8` (`FastOps(activations="int8")`, the int8-activation contract in
csrc/mt.h) rounds the input of every int8/int4 linear whose groups are whole blocks of 64 to int8
per block, and multiplies in integers (AVX-512 VNNI, AVX2 maddubs). It is LOSSY; this measures
the loss on one container at a time, int8 against the exact kernels (the default):

  * teacher-forced logits over the first `--tokens` tokens of a shipped text: top-1 agreement
    (positions whose arg max is the same token), the logit error relative to the exact logits
    (RMS of the difference over RMS of the exact logits, all positions), the largest absolute
    difference, and the mean KL divergence of int8's next-token distribution from exact's;
  * greedy generation of `--generate` tokens after a `--prompt-tokens` prompt in each mode: how
    many tokens the two agree on before the first difference.

Models: the trained demo model (what `moetier up` serves; its trained weights make top-1 a
fair measure) and the test-sized synth model of every architecture (`tiny-*`: random weights,
whose near-flat logits make top-1 agreement a harsh measure), each the container the project
builds for it (int4 g64 experts, int8 dense), built once under data_dir/models/; `--model DIR`
(repeatable) adds containers, e.g. bench peers' olmoe-1b-7b conversions. A model none of whose
linears is inside the contract shows no difference and is marked so.

With `--json`: one object, `ratio` being the trained demo model's top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.bench import models
from moetier.errors import InvalidArgument
from moetier.settings import load_settings

F32 = npt.NDArray[np.float32]


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "activations", help="the int8-activation mode (lossy) against the exact kernels: top-1 agreement and "
        "logit error per architecture")
    p.add_argument("--model", type=Path, action="append", default=[],
                   help="also measure this container (repeatable)")
    p.add_argument("--presets", default="tiny",
                   help="synth presets to measure besides the demo model: 'tiny' (every architecture's test-sized "
                   "model, default), a comma list of preset names, or 'none'")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the models live)")
    p.add_argument("--tokens", type=int, default=256, help="teacher-forced tokens of shipped text (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt of the greedy comparison (default 32)")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens per mode (default 32)")
    p.add_argument("--threads", type=int, help="kernel threads (default: every CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass
class Row:
    model: str
    arch: str
    kind: str  # trained, synth, given
    positions: int
    top1: float  # share of positions with the same arg max
    rel_rms: float  # RMS(int8 - exact) / RMS(exact), all logits
    max_abs: float
    kl: float  # mean KL(exact || int8), nats
    greedy_equal: int  # tokens equal before the first difference
    greedy_tokens: int
    identical: bool  # int8 gave the exact bits: no linear inside the contract


def compare(exact: F32, int8: F32) -> dict[str, float]:
    """The figures of two [T, V] logit arrays (int8 against exact)."""
    e, q = exact.astype(np.float64), int8.astype(np.float64)
    top1 = float(np.mean(np.argmax(e, axis=1) == np.argmax(q, axis=1)))
    rms = float(np.sqrt(np.mean(e * e)))
    diff = q - e
    rel = float(np.sqrt(np.mean(diff * diff)) / rms) if rms > 0 else 0.0

    def log_softmax(a: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        z = a - a.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    le, lq = log_softmax(e), log_softmax(q)
    kl = float(np.mean(np.sum(np.exp(le) * (le - lq), axis=1)))
    return {"top1": top1, "rel_rms": rel, "max_abs": float(np.abs(diff).max()), "kl": max(kl, 0.0)}


def first_difference(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(path: Path, name: str, kind: str, args: argparse.Namespace) -> Row:
    from moetier.engine import Engine
    from moetier.kernels.fast import Activations
    from moetier.model.sampling import SamplingParams

    logits: dict[str, F32] = {}
    greedy: dict[str, list[int]] = {}
    arch = ""
    modes: tuple[Activations, ...] = ("exact", "int8")
    for mode in modes:
        with Engine.open(path, budget="100%", threads=args.threads, activations=mode) as eng:
            arch = eng.model.args.arch
            n = min(args.tokens, eng.model.args.max_position_embeddings)
            ids = models.prompt_ids(eng.tokenizer, n)
            logits[mode] = eng.logits(ids)
            params = SamplingParams(temperature=0.0, max_tokens=args.generate, ignore_eos=True)
            greedy[mode] = [t.token for t in eng.generate(ids[: args.prompt_tokens], params)]
    figs = compare(logits["exact"], logits["int8"])
    return Row(name, arch, kind, len(logits["exact"]), figs["top1"], figs["rel_rms"], figs["max_abs"], figs["kl"],
               first_difference(greedy["exact"], greedy["int8"]), len(greedy["exact"]),
               bool(np.array_equal(logits["exact"].view(np.uint32), logits["int8"].view(np.uint32))))


def targets(args: argparse.Namespace) -> list[tuple[Path, str, str]]:
    """(container, name, kind) in the order measured: the demo model, the presets, the given ones."""
    from moetier.convert.synth import PRESETS
    from moetier.engine import ensure_demo_model, trained_demo_source

    settings = load_settings(args.config)
    out = [(ensure_demo_model(settings), "demo", "trained" if trained_demo_source() is not None else "synth")]
    spec = args.presets.strip()
    if spec == "tiny":
        names = [p for p in PRESETS if p.startswith("tiny-")]
    elif spec in ("", "none"):
        names = []
    else:
        names = [p.strip() for p in spec.split(",") if p.strip()]
        unknown = [p for p in names if p not in PRESETS]
        if unknown:
            raise InvalidArgument(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    out += [(models.benchmark_model(p, settings), p, "synth") for p in names]
    for m in args.model:
        path = Path(m).expanduser()
        if not models.is_complete(path):
            raise InvalidArgument(f"{path} is not a complete moetier container (no {models.MANIFEST})")
        out.append((path, path.name, "given"))
    return out


def run(args: argparse.Namespace) -> int:
    from moetier.kernels.fast import FastOps

    for flag in ("tokens", "prompt_tokens", "generate"):
        if getattr(args, flag) < 1:
            raise InvalidArgument(f"--{flag.replace('_', '-')} must be at least 1")
    backend = FastOps(threads=args.threads, activations="int8").backend
    rows = [measure(path, name, kind, args) for path, name, kind in targets(args)]
    if args.json:
        print(json.dumps({"backend": backend, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                          "generate": args.generate, "rows": [asdict(r) for r in rows],
                          "ratio": rows[0].top1}))
        return 0
    print(f"moetier bench activations: int8 activations (LOSSY) against the exact kernels, FastOps {backend}; "
          f"teacher-forced over {args.tokens} tokens of shipped text, greedy {args.generate} tokens after a "
          f"{args.prompt_tokens}-token prompt")
    w = max(22, *(len(r.model) for r in rows))
    print(f"{'model':<{w}} {'arch':<18} {'weights':<8} {'top-1 agree':>11} {'logit err':>10} {'max |diff|':>10} "
          f"{'KL nats':>9} {'greedy equal':>13}")
    for r in rows:
        note = "  (no linear inside the int8 contract: exact)" if r.identical else ""
        print(f"{r.model:<{w}} {r.arch:<18} {r.kind:<8} {100 * r.top1:>10.1f}% {100 * r.rel_rms:>9.2f}% "
              f"{r.max_abs:>10.4f} {r.kl:>9.2e} {r.greedy_equal:>6}/{r.greedy_tokens:<6}{note}")
    print("logit err: RMS of (int8 - exact) / RMS of exact, over every logit; KL: mean over positions of "
          "KL(exact || int8) of the next-token distributions")
    return 0
