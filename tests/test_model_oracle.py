"""The numpy forward pass against Hugging Face transformers, for every supported architecture.

Fixture tests need no torch: they rebuild each tiny checkpoint from its recorded generator and
seed, check its checksum, load it through the adapters (float32) and compare with the logits
and greedy tokens transformers produced (tests/fixtures/oracle, scripts/make_oracle_fixtures.py).
Live tests run transformers itself, on the fixtures' checkpoints and on config variants.
"""

from __future__ import annotations

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


def load_fixture(arch: str) -> dict[str, Any]:
    with np.load(FIXTURES / f"{arch}.npz", allow_pickle=False) as z:
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


@pytest.mark.parametrize("arch", hf.ARCHS)
def test_fixture(arch: str, tmp_path: Path) -> None:
    fx = load_fixture(arch)
    ckpt = hf.make_checkpoint(str(fx["generator"]), str(fx["preset"]), tmp_path / "ckpt", int(fx["seed"]))
    assert hf.checkpoint_checksum(ckpt) == str(fx["checksum"]), (
        f"the {fx['preset']} checkpoint from {fx['generator']} changed since the fixture was made: "
        "regenerate with scripts/make_oracle_fixtures.py"
    )
    model = hf.build_model(ckpt)
    assert_logits_close(teacher_forced_logits(model, fx["prompt"]), fx["logits"])
    assert_greedy_matches(model, fx["prompt"], fx["greedy"], fx["greedy_gap"])


# Config variants the fixtures do not cover: checked live against transformers.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # no q_lora, rotate_half rope, no yarn, no groups, no renormalisation
    "deepseek_v3-plain": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    # greedy top-k, q_lora, DeepSeek-V2's own yarn (mscale == mscale_all_dim)
    "deepseek_v2-yarn": ("deepseek_v2", {
        "topk_method": "greedy", "q_lora_rank": 24,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "beta_fast": 32, "beta_slow": 1},
    }),
    # grouped sigmoid router, no qk norm, no bias
    "glm4_moe-groups": ("glm4_moe", {"n_group": 4, "topk_group": 2, "use_qk_norm": False, "attention_bias": False}),
}
LIVE = [(a, a, {}) for a in hf.ARCHS] + [(name, arch, ov) for name, (arch, ov) in VARIANTS.items()]


@pytest.mark.skipif(not hf.hf_available(), reason="torch/transformers not installed (the [oracle] extra)")
@pytest.mark.parametrize("name,arch,overrides", LIVE, ids=[x[0] for x in LIVE])
def test_live(name: str, arch: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    ckpt = hf.write_tiny_checkpoint(arch, tmp_path / "ckpt", seed=1, overrides=overrides)
    prompt = hf.prompt_ids(hf.tiny_config(arch)["vocab_size"], seed=1, n=16)
    ref = hf.hf_reference(ckpt, prompt, 12)
    model = hf.build_model(ckpt)
    assert_logits_close(teacher_forced_logits(model, prompt), ref["logits"])
    assert_greedy_matches(model, prompt, ref["greedy"], ref["greedy_gap"])
