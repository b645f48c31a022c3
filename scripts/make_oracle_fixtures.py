"""Write the oracle fixtures tests/fixtures/oracle/<case>.npz from Hugging Face transformers.

Cases (tests/helpers_hf.py, CASES): `<arch>` is the synth preset tiny-<arch>
(moetier.convert.synth); `<arch>-quirks` and the named variants come from the seeded writer
in tests/helpers_hf.py, configured to exercise what the synth presets leave neutral. For each
case: build the float32 checkpoint, run transformers (float32, eager attention, eager
experts) and store

    prompt      int64 [T]        the prompt, drawn from the seed
    logits      float32 [T, V]   teacher-forced logits over the prompt
    greedy      int64 [N]        transformers' greedy continuation (eos ignored)
    greedy_gap  float32 [N]      its top-1 minus top-2 logit at each generated position
    index_gap   float32          DSA models: the smallest gap at any indexer's top-k boundary (inf
                                 without an indexer); a case whose choice hangs on a near-tie is
                                 refused, since no implementation defines the order of ties
    draft_logits float32 [T-1, V] checkpoints with MTP layers: transformers' MtpModel (layer 0),
                                 teacher-forced over the prompt (helpers_hf.hf_mtp_reference)
    generator, preset, seed, overrides (JSON), checksum (xxh3_64 of the safetensors),
    transformers_version, torch_version

Tests rebuild the checkpoint from (generator, preset, seed, overrides) without torch, check
the checksum (a generator that drifted fails loudly) and compare the numpy forward pass.

Needs the [oracle] extra (torch, transformers):
    .venv/bin/python scripts/make_oracle_fixtures.py [--case deepseek_v3 ...]
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


def make_fixture(case: hf.Case, out_dir: Path) -> Path:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = hf.make_checkpoint(case.generator, case.preset, Path(tmp) / "ckpt", case.seed, case.overrides)
        vocab = hf.vocab_of(ckpt)
        prompt = hf.prompt_ids(vocab, case.seed, case.prompt_tokens)
        ref = hf.hf_reference(ckpt, prompt, case.greedy_tokens)
        if float(ref["index_gap"]) < hf.INDEX_TIE:
            raise SystemExit(f"{case.name}: an indexer top-k boundary is a near-tie in transformers "
                             f"(gap {float(ref['index_gap']):.2e}); choose another config or seed")
        checksum = hf.checkpoint_checksum(ckpt)
        extra = {}
        if hf.has_mtp(ckpt):
            extra["draft_logits"] = hf.hf_mtp_reference(ckpt, prompt)["draft_logits"]
    out = out_dir / f"{case.name}.npz"
    np.savez_compressed(
        out,
        prompt=prompt,
        logits=ref["logits"],
        greedy=ref["greedy"],
        greedy_gap=ref["greedy_gap"],
        index_gap=ref["index_gap"],
        generator=np.str_(case.generator),
        preset=np.str_(case.preset),
        seed=np.int64(case.seed),
        overrides=np.str_(json.dumps(case.overrides, sort_keys=True)),
        checksum=np.str_(checksum),
        transformers_version=np.str_(transformers.__version__),
        torch_version=np.str_(torch.__version__),
        **extra,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", choices=sorted(hf.CASES), help="case (repeatable; default: all)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    if not hf.hf_available():
        p.error("torch and transformers are needed (pip install -e '.[oracle]')")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.case or hf.CASES:
        case = hf.CASES[name]
        path = make_fixture(case, a.out)
        z = np.load(path)
        gap, igap = float(z["greedy_gap"].min()), float(z["index_gap"])
        print(f"{name:20s} {path.name:26s} {path.stat().st_size // 1024:3d} KiB  {case.generator} {case.preset}  "
              f"smallest greedy gap {gap:.2e}, indexer gap {igap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
