"""`moetier logits`: teacher-forced logits of a token-id sequence, saved as .npy [T, V] float32."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from moetier.settings import apply_kernel_settings, load_settings


def _run(args: argparse.Namespace) -> int:
    from moetier.engine import Engine, expert_cache_spec, model_dir, parse_ids

    settings = load_settings(args.config)
    apply_kernel_settings(settings)
    path = model_dir(settings, args.model)
    ids = parse_ids(args.ids)
    with Engine.open(path, budget=expert_cache_spec(settings, args.budget), reference=args.reference,
                     threads=args.threads) as engine:
        logits = engine.logits(ids).astype(np.float32, copy=False)
    np.save(args.out, logits)
    print(f"wrote logits {list(logits.shape)} float32 to {args.out}")
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("logits", help="teacher-forced logits of token ids (.npy)")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path, else the demo model)")
    p.add_argument("--ids", required=True, help="token ids, e.g. 1,2,3")
    p.add_argument("--out", type=Path, required=True, help="output .npy file: float32 [T, vocab]")
    p.add_argument("--reference", action="store_true", help="plain numpy ReferenceOps instead of FastOps")
    p.add_argument("--budget", help="expert RAM tier (default: settings model.expert_cache)")
    p.add_argument("--threads", type=int, help="kernel threads (default: every CPU)")
    p.set_defaults(func=_run)
