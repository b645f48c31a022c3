"""Hidden-config oracle for the DSA families: configs no test has seen, checked end to end.

For each (architecture, seed) this draws a `glm_moe_dsa` or `deepseek_v32` config from the seed
(layers, heads, MLA ranks, index_topk, index heads and width, the schedule of full and shared
indexer layers, dense/sparse MLP layers, yarn or not, groups), lets transformers build the
random checkpoint itself (`from_config`, weights re-drawn at O(1) scale, `save_pretrained` in
float32), then runs the real commands

    moetier convert CKPT OUT --experts f32 --dense f32
    moetier logits --model OUT --ids ... --out logits.npy

and compares with transformers' own logits (float32, eager): max |error| <= 1e-4 x max |logit|.
A prompt on which transformers' indexer chose among near-ties (tests/helpers_hf.py, IndexGaps) is
redrawn, since no implementation defines the order of ties.

    .venv/bin/python scripts/oracle_hidden.py [--arch glm_moe_dsa] [--seeds 0-9]

Needs the [oracle] extra (torch, transformers). tests/test_oracle_hidden.py runs a few seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import helpers_hf as hf  # noqa: E402  (tests/ is not a package)

ARCHS = ("glm_moe_dsa", "deepseek_v32")
LOGIT_RTOL = 1e-4
PROMPT_TRIES = 5


def draw_config(arch: str, seed: int) -> dict[str, Any]:
    """A config of `arch` drawn from `seed` (never one of the fixtures' configs)."""
    r = np.random.default_rng([seed, 12])
    layers = int(r.integers(2, 6))
    heads = int(r.choice([2, 4, 6]))
    rope = int(r.choice([4, 8]))
    cfg: dict[str, Any] = {
        "model_type": arch, "vocab_size": 384, "hidden_size": int(r.choice([48, 64, 96])),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": int(r.choice([16, 24, 40])), "kv_lora_rank": int(r.choice([16, 32])),
        "qk_nope_head_dim": int(r.choice([8, 16])), "qk_rope_head_dim": rope, "v_head_dim": int(r.choice([8, 16])),
        "intermediate_size": 96, "moe_intermediate_size": int(r.choice([16, 32])),
        "n_routed_experts": 8, "num_experts_per_tok": int(r.choice([2, 3])), "n_shared_experts": int(r.integers(0, 3)),
        "routed_scaling_factor": float(r.choice([1.0, 2.5])), "norm_topk_prob": bool(r.integers(2)),
        "first_k_dense_replace": int(r.integers(0, 2)), "max_position_embeddings": 256, "attention_bias": False,
        "index_topk": int(r.integers(3, 11)), "index_n_heads": int(r.choice([12, 16, 24])),
        "index_head_dim": int(r.choice([rope * 2, rope * 3, 32])), "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32", "initializer_range": 0.02,
    }
    cfg["n_group"], cfg["topk_group"] = ((2, 1) if r.integers(2) else (1, 1))
    if r.integers(2):
        factor = float(r.choice([2.0, 4.0]))
        cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                                  "original_max_position_embeddings": int(256 / factor), "mscale": 1.0,
                                  "mscale_all_dim": float(r.choice([0.707, 1.0])), "beta_fast": 32, "beta_slow": 1}
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": float(r.choice([10000.0, 50000.0]))}
    if r.integers(2):
        cfg["mlp_layer_types"] = ["sparse" if r.random() < 0.7 else "dense" for _ in range(layers)]
    if arch == "glm_moe_dsa":
        types = ["full"] + ["full" if r.random() < 0.4 else "shared" for _ in range(layers - 1)]
        how = int(r.integers(3))
        if how == 0:
            cfg["indexer_types"] = types
        elif how == 1:
            cfg["index_topk_pattern"] = "".join("F" if t == "full" else "S" for t in types)
        else:
            cfg["index_topk_freq"], cfg["index_skip_topk_offset"] = int(r.integers(1, 4)), int(r.integers(1, 3))
    return cfg


def _redraw(model: Any, seed: int) -> None:
    """O(1)-scale weights in place of transformers' 0.02-std init (so logits are well separated)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * z)
            elif name.endswith("bias"):
                p.copy_(0.1 * z)
            else:
                p.copy_(z / float(np.sqrt(p.shape[-1])))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_checkpoint(cfg: dict[str, Any], out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def moetier(*argv: str) -> str:
    from moetier.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    if rc != 0:
        raise RuntimeError(f"moetier {' '.join(argv)} exited {rc}: {buf.getvalue()}")
    return buf.getvalue()


@dataclass(frozen=True)
class Outcome:
    arch: str
    seed: int
    error: float
    tolerance: float
    index_topk: int
    schedule: str  # F/S per layer
    prompt_tries: int

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def check(arch: str, seed: int, work: Path) -> Outcome:
    cfg = draw_config(arch, seed)
    ckpt = build_checkpoint(cfg, work / "ckpt", seed)
    out = work / "container"
    moetier("convert", str(ckpt), str(out), "--experts", "f32", "--dense", "f32")
    saved = json.loads((ckpt / "config.json").read_text())
    args = json.loads((out / "moetier.json").read_text())["model"]
    schedule = "".join("F" if f else "S" for f in args["indexer_layers"])
    for attempt in range(1, PROMPT_TRIES + 1):
        prompt = hf.prompt_ids(int(saved["vocab_size"]), seed * 100 + attempt, 20 + 2 * cfg["index_topk"])
        ref = hf.hf_reference(ckpt, prompt, 0)
        if float(ref["index_gap"]) < hf.INDEX_TIE:
            continue  # transformers chose among near-ties: another prompt
        moetier("logits", "--model", str(out), "--ids", ",".join(map(str, prompt)), "--out", str(work / "l.npy"))
        ours = np.load(work / "l.npy")
        err = float(np.abs(ours - ref["logits"]).max())
        return Outcome(arch, seed, err, LOGIT_RTOL * float(np.abs(ref["logits"]).max()), cfg["index_topk"],
                       schedule, attempt)
    raise RuntimeError(f"{arch} seed {seed}: transformers' indexer hit near-ties on {PROMPT_TRIES} prompts")


def _seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", choices=ARCHS, help="architecture (repeatable; default: both)")
    p.add_argument("--seeds", default="0-4", help="seeds, e.g. 0-9 or 3,5,8")
    a = p.parse_args(argv)
    if not hf.hf_available():
        p.error("torch and transformers are needed (pip install -e '.[oracle]')")
    failed = 0
    for arch in a.arch or ARCHS:
        for seed in _seeds(a.seeds):
            with tempfile.TemporaryDirectory() as tmp:
                o = check(arch, seed, Path(tmp))
            failed += not o.ok
            print(f"{arch:13s} seed {seed:3d}  index_topk {o.index_topk:2d}  layers {o.schedule:6s}  "
                  f"max|err| {o.error:.2e} <= {o.tolerance:.2e}: {'ok' if o.ok else 'FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
