"""Write the oracle fixtures tests/fixtures/oracle/<arch>.npz from Hugging Face transformers.

For each architecture: build the `tiny-<arch>` checkpoint from a seed (the project's synth,
moetier.convert.synth, when it exists; else the seeded writer in tests/helpers_hf.py), run
transformers on it (float32, eager attention, eager experts) and store

    prompt      int64 [T]        the prompt (T = 24), drawn from the seed
    logits      float32 [T, V]   teacher-forced logits over the prompt
    greedy      int64 [32]       transformers' greedy continuation (eos ignored)
    greedy_gap  float32 [32]     its top-1 minus top-2 logit at each generated position
    generator, preset, seed, checksum (xxh3_64 of the checkpoint's safetensors),
    transformers_version, torch_version

Tests rebuild the checkpoint from (generator, preset, seed) without torch, check the checksum
(drift in the generator fails loudly) and compare the numpy forward with these numbers.

Needs the [oracle] extra (torch, transformers):
    .venv/bin/python scripts/make_oracle_fixtures.py [--arch deepseek_v3 ...] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import helpers_hf as hf  # noqa: E402  (tests/ is not a package)

OUT = ROOT / "tests" / "fixtures" / "oracle"
PROMPT_TOKENS = 24
GREEDY_TOKENS = 32


def make_fixture(arch: str, seed: int, generator: str, out_dir: Path) -> Path:
    import torch
    import transformers

    preset = f"tiny-{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = hf.make_checkpoint(generator, preset, Path(tmp) / preset, seed)
        vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
        prompt = hf.prompt_ids(vocab, seed, PROMPT_TOKENS)
        ref = hf.hf_reference(ckpt, prompt, GREEDY_TOKENS)
        checksum = hf.checkpoint_checksum(ckpt)
    out = out_dir / f"{arch}.npz"
    np.savez_compressed(
        out,
        prompt=prompt,
        logits=ref["logits"],
        greedy=ref["greedy"],
        greedy_gap=ref["greedy_gap"],
        generator=np.str_(generator),
        preset=np.str_(preset),
        seed=np.int64(seed),
        checksum=np.str_(checksum),
        transformers_version=np.str_(transformers.__version__),
        torch_version=np.str_(torch.__version__),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", choices=hf.ARCHS, help="architecture (repeatable; default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator", choices=(hf.SYNTH_MODULE, hf.HELPER_GENERATOR), default=hf.default_generator(),
                   help="checkpoint generator (default: synth when it exists)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    if not hf.hf_available():
        p.error("torch and transformers are needed (pip install -e '.[oracle]')")
    a.out.mkdir(parents=True, exist_ok=True)
    for arch in a.arch or hf.ARCHS:
        path = make_fixture(arch, a.seed, a.generator, a.out)
        gap = float(np.load(path)["greedy_gap"].min())
        print(f"{arch:12s} {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}  "
              f"({path.stat().st_size // 1024} KiB, generator {a.generator}, smallest greedy gap {gap:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
