"""`moetier synth`: build a random checkpoint of a named shape (HF layout or a container)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.convert import synth
from moetier.weights.schema import DENSE_ALLOWED, EXPERTS_ALLOWED


def _run(args: argparse.Namespace) -> int:
    if args.list:
        for name in synth.PRESETS:
            d = synth.describe(name)
            shape_only = "" if d["materialize"] else "  (shape only)"
            print(f"{name:<18} {d['arch']:<12} {d['layers']:>3} layers  {d['experts']:>3} experts top-{d['top_k']:<2}"
                  f" {d['expert_bytes_int4'] / 1e9:>8.2f} GB int4 experts{shape_only}")
        return 0
    if args.mtp == "int4" and args.format == "container":  # the shape printout too: it is not what we write
        from moetier.convert.converter import MTP_INT4_REFUSED
        from moetier.errors import InvalidArgument

        raise InvalidArgument(MTP_INT4_REFUSED)
    if args.preset and not args.out:
        print(synth.format_shape(synth.shape_report(args.preset, args.experts, args.dense, args.group_size,
                                                    args.mtp)))
        return 0
    if not args.preset or not args.out:
        print("moetier synth: --preset and --out are required (or --list)")
        return 2
    out = Path(args.out)
    if args.if_missing and (out / ("moetier.json" if args.format == "container" else "config.json")).exists():
        print(f"{out} already holds a {args.format} checkpoint; left as it is (--if-missing)")
        return 0
    if args.format == "hf":
        synth.write_hf_checkpoint(args.preset, out, args.seed, dtype=args.hf_dtype, mxfp4=args.hf_mxfp4)
    else:
        synth.write_container(args.preset, out, args.seed, args.experts, args.dense, args.group_size,
                              progress=True, mtp=None if args.mtp == "none" else args.mtp)
    print(f"wrote {args.format} checkpoint of preset {args.preset} (seed {args.seed}) to {out}")
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("synth", help="build a random checkpoint of a named shape")
    p.add_argument("--preset", help="preset name (see --list)")
    p.add_argument("--out", help="output directory (without it: print the preset's shape and sizes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("hf", "container"), default="container")
    p.add_argument("--experts", choices=EXPERTS_ALLOWED, default="int4", help="container only")
    p.add_argument("--dense", choices=DENSE_ALLOWED, default="int8", help="container only")
    p.add_argument("--group-size", type=int, default=64, help="container only")
    p.add_argument("--mtp", choices=("int8", "bf16", "f32", "int4", "none"), default="int8",
                   help="the MTP layers of presets that have them (container only; int4 is refused)")
    p.add_argument("--hf-dtype", choices=("bf16", "f32", "f16"), default="bf16", help="hf only")
    p.add_argument("--hf-mxfp4", action="store_true",
                   help="hf only, gpt_oss presets: the experts as MXFP4 blocks and scales, as gpt-oss is released")
    p.add_argument("--list", action="store_true", help="list presets and their sizes")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when OUT already holds a complete checkpoint (for start-up scripts)")
    p.set_defaults(func=_run)
