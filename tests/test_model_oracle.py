"""The numpy forward pass against Hugging Face transformers, for every supported architecture.

Fixture tests need no torch: they rebuild each tiny checkpoint from the generator, preset,
seed and overrides recorded in its fixture, check its checksum, load it through the adapters
(float32) and compare with the logits and greedy tokens transformers produced
(tests/fixtures/oracle, made by scripts/make_oracle_fixtures.py).
Live tests, where torch and transformers are installed, run transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helpers_hf as hf
import numpy as np
import pytest

from moetier.model.forward import Model
from moetier.model.generate import generate, teacher_forced_logits
from moetier.model.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures" / "oracle"
LOGIT_RTOL = 1e-4  # of max |logit|
TIE_GAP = 1e-5  # transformers' own top-2 gap below which a greedy choice is a coin flip


def load_fixture(name: str) -> dict[str, Any]:
    with np.load(FIXTURES / f"{name}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    tol = LOGIT_RTOL * float(np.abs(ref).max())
    err = float(np.abs(ours - ref).max())
    assert err <= tol, f"max |logit error| {err:.3e} > {tol:.3e}"


def assert_greedy_matches(model: Model, prompt: np.ndarray, ref_tokens: np.ndarray, ref_gap: np.ndarray) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=len(ref_tokens), ignore_eos=True)
    ours = [g.token for g in generate(model, prompt, params)]
    assert len(ours) == len(ref_tokens)
    for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)):
        if ref_gap[i] < TIE_GAP:
            return  # a near-tie in transformers itself: the continuations may part here
        assert a == b, f"greedy token {i}: ours {a}, transformers {b} (its top-2 gap {ref_gap[i]:.2e})"


@pytest.mark.parametrize("name", sorted(hf.CASES))
def test_fixture(name: str, tmp_path: Path) -> None:
    fx = load_fixture(name)
    generator, preset = str(fx["generator"]), str(fx["preset"])
    ckpt = hf.make_checkpoint(generator, preset, tmp_path / "ckpt", int(fx["seed"]), json.loads(str(fx["overrides"])))
    assert hf.checkpoint_checksum(ckpt) == str(fx["checksum"]), (
        f"{preset} from {generator} is no longer the checkpoint the fixture was made from: "
        "regenerate with scripts/make_oracle_fixtures.py"
    )
    model = hf.build_model(ckpt)
    assert_logits_close(teacher_forced_logits(model, fx["prompt"]), fx["logits"])
    assert_greedy_matches(model, fx["prompt"], fx["greedy"], fx["greedy_gap"])
    assert ("draft_logits" in fx) == hf.has_mtp(ckpt)
    if "draft_logits" in fx:
        assert_logits_close(draft_logits(ckpt, fx["prompt"]), fx["draft_logits"])


def draft_logits(ckpt: Path, prompt: np.ndarray) -> np.ndarray:
    """Our MTP layer 0, teacher-forced as helpers_hf.hf_mtp_reference runs transformers': [T-1, V]."""
    model, head = hf.build_model_and_mtp(ckpt)
    hidden = model.forward([(model.new_cache(), prompt)])[0]  # [T, D] final-normed
    out = head.step(0, [(head.new_caches()[0], prompt[1:], hidden[:-1], 1)])[0]  # positions 1..T-1
    return model.head(out)


# Live runs on the quirk configs and variants (a superset of what the synth presets exercise),
# with another seed than the fixtures.
LIVE = sorted(n for n, c in hf.CASES.items() if c.generator == hf.HELPER_GENERATOR)


@pytest.mark.skipif(not hf.hf_available(), reason="torch/transformers not installed (the [oracle] extra)")
@pytest.mark.parametrize("name", LIVE)
def test_live(name: str, tmp_path: Path) -> None:
    case = hf.CASES[name]
    ckpt = hf.make_checkpoint(case.generator, case.preset, tmp_path / "ckpt", case.seed + 1, case.overrides)
    vocab = hf.vocab_of(ckpt)
    prompt = hf.prompt_ids(vocab, case.seed + 1, 12)
    ref = hf.hf_reference(ckpt, prompt, 8)
    if float(ref["index_gap"]) < hf.INDEX_TIE:
        pytest.skip(f"transformers' indexer chose among near-ties (gap {float(ref['index_gap']):.1e})")
    model = hf.build_model(ckpt)
    assert_logits_close(teacher_forced_logits(model, prompt), ref["logits"])
    assert_greedy_matches(model, prompt, ref["greedy"], ref["greedy_gap"])


# The MTP layers of the four MTP families against transformers' MtpModel, live, another seed and
# prompt than the fixtures.
@pytest.mark.skipif(not hf.hf_available(), reason="torch/transformers not installed (the [oracle] extra)")
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"])
def test_live_mtp(arch: str, tmp_path: Path) -> None:
    ckpt = hf.make_checkpoint(hf.SYNTH_MODULE, f"tiny-{arch}", tmp_path / "ckpt", 5)
    prompt = hf.prompt_ids(512, 5, 20)
    ref = hf.hf_mtp_reference(ckpt, prompt)["draft_logits"]
    assert_logits_close(draft_logits(ckpt, prompt), ref)
