"""Sampling and generation: seeds, greedy, top-k/top-p, penalties, stop tokens, logprobs."""

from __future__ import annotations

from pathlib import Path

import helpers_hf as hf
import numpy as np
import pytest

from moetier.model.forward import Model
from moetier.model.generate import generate
from moetier.model.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    greedy_token,
    log_softmax,
    logits_to_probs,
    sample,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    # The helper generator's random readout gives flat next-token distributions, so sampling
    # choices (seeds, penalties) visibly matter; synth models are as confident as trained ones.
    case = hf.CASES["qwen3_moe-quirks"]
    root: Path = tmp_path_factory.mktemp("ckpt")
    return hf.build_model(hf.make_checkpoint(case.generator, case.preset, root, 0))


PROMPT = [5, 17, 99, 3, 250, 41]


def run(model: Model, **kw: object) -> list[int]:
    return [g.token for g in generate(model, PROMPT, SamplingParams(ignore_eos=True, **kw))]  # type: ignore[arg-type]


def test_same_seed_same_tokens(model: Model) -> None:
    a = run(model, temperature=1.5, seed=7, max_tokens=12)
    assert a == run(model, temperature=1.5, seed=7, max_tokens=12)
    assert a != run(model, temperature=1.5, seed=8, max_tokens=12)


def test_top_k_one_and_tiny_top_p_are_greedy(model: Model) -> None:
    greedy = run(model, temperature=0.0, max_tokens=10)
    assert run(model, temperature=1.0, top_k=1, seed=1, max_tokens=10) == greedy
    assert run(model, temperature=1.0, top_p=1e-6, seed=2, max_tokens=10) == greedy


def test_frequency_penalty_stops_repeats(model: Model) -> None:
    toks = run(model, temperature=0.0, max_tokens=24, frequency_penalty=100.0)
    assert len(set(toks)) == len(toks)
    assert len(set(run(model, temperature=0.0, max_tokens=24))) < 24  # greedy alone repeats here


def test_penalties_formula() -> None:
    logits = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    counts = np.array([0, 1, 3, 0])
    np.testing.assert_allclose(apply_penalties(logits, counts, 0.5, 0.25), [1.0, 1.25, 1.75, 4.0])
    assert apply_penalties(logits, counts, 0.0, 0.0) is logits
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=10.0), 4)
    assert [s.choose(logits).token for _ in range(4)] == [3, 2, 1, 0]  # each token once, then the next


def test_logits_to_probs_truncation() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3], np.float32))
    np.testing.assert_allclose(logits_to_probs(logits, 1.0), [0.1, 0.4, 0.2, 0.3], rtol=1e-6)
    np.testing.assert_allclose(logits_to_probs(logits, 1.0, top_k=2), [0, 4 / 7, 0, 3 / 7], rtol=1e-6)
    np.testing.assert_allclose(logits_to_probs(logits, 1.0, top_p=0.65), [0, 4 / 7, 0, 3 / 7], rtol=1e-6)
    np.testing.assert_allclose(logits_to_probs(logits, 1.0, top_p=0.75), [0, 4 / 9, 2 / 9, 3 / 9], rtol=1e-6)
    hot = logits_to_probs(logits, 0.01)
    assert hot[1] > 0.999
    assert greedy_token(np.array([1.0, 3.0, 3.0], np.float32)) == 1  # lowest id on ties


def test_sample_follows_the_distribution() -> None:
    p = np.array([0.0, 0.5, 0.0, 0.25, 0.25])
    rng = np.random.default_rng(0)
    draws = np.bincount([sample(p, rng) for _ in range(4000)], minlength=5) / 4000
    assert draws[0] == draws[2] == 0
    np.testing.assert_allclose(draws, p, atol=0.03)


def test_stop_tokens_and_length(model: Model) -> None:
    free = run(model, temperature=0.0, max_tokens=8)
    out = list(generate(model, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(free[3],))))
    assert [g.token for g in out] == free[: free.index(free[3]) + 1]
    assert out[-1].finish_reason == "stop" and all(g.finish_reason is None for g in out[:-1])
    out = list(generate(model, PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)))
    assert len(out) == 5 and out[-1].finish_reason == "length"
    assert list(generate(model, PROMPT, SamplingParams(max_tokens=0))) == []


def test_eos_stops_unless_ignored() -> None:
    s = Sampler(SamplingParams(), 10, eos_token_ids=(2,))
    assert s.finish_reason(2) == "stop"
    s = Sampler(SamplingParams(ignore_eos=True), 10, eos_token_ids=(2,))
    assert s.finish_reason(2) is None


def test_logprobs(model: Model) -> None:
    out = list(generate(model, PROMPT, SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=True,
                                                      top_logprobs=3, ignore_eos=True)))
    for g in out:
        assert g.logprob is not None and g.logprob <= 0
        assert len(g.top_logprobs) == 3
        lps = [lp for _, lp in g.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        if g.token in dict(g.top_logprobs):
            assert dict(g.top_logprobs)[g.token] == pytest.approx(g.logprob)
    x = np.array([0.5, -1.0, 2.0], np.float32)
    np.testing.assert_allclose(np.exp(log_softmax(x)).sum(), 1.0, rtol=1e-6)
    assert next(generate(model, PROMPT, SamplingParams(max_tokens=1))).logprob is None


def test_params_are_validated() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
