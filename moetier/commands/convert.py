"""`moetier convert SRC OUT`: Hugging Face safetensors checkpoint -> container (resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetier.convert.converter import ConvertOptions, convert
from moetier.errors import ConversionError
from moetier.weights.schema import DENSE_ALLOWED, EXPERTS_ALLOWED


def _run(args: argparse.Namespace) -> int:
    opts = ConvertOptions(experts=args.experts, dense=args.dense, group_size=args.group_size, mtp=args.mtp)
    try:
        out = convert(Path(args.src), Path(args.out), opts)
    except OSError as e:
        raise ConversionError(f"{e.filename or args.out}: {e.strerror or e}") from e
    print(f"converted {args.src} -> {out}")
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("convert", help="convert a Hugging Face checkpoint to a container")
    p.add_argument("src", help="checkpoint directory (config.json + safetensors) or a .safetensors file")
    p.add_argument("out", help="output container directory (an interrupted conversion resumes)")
    p.add_argument("--experts", choices=EXPERTS_ALLOWED, default=None,
                   help="routed experts' dtype (default int4; an MXFP4 source, gpt-oss as released, keeps its "
                        "experts as mxfp4, lossless)")
    p.add_argument("--dense", choices=DENSE_ALLOWED, default="int8")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--mtp", choices=("int8", "bf16", "f32", "int4", "none"), default="int8",
                   help="the checkpoint's MTP layers (default int8; int4 is refused; none: leave them out)")
    p.set_defaults(func=_run)
