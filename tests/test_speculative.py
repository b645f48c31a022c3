"""Speculative decoding with the MTP head, in-process (moetier/speculation.py, model/speculative.py):
greedy output bit-identical to plain decoding, the target distribution kept at temperature > 0,
logprobs, stop tokens, max_tokens and the prefix cache unchanged by rejected drafts, and the
cost model's decisions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from moetier.convert.synth import write_container
from moetier.engine import Engine
from moetier.model.sampling import Sampler, SamplingParams, logits_to_probs
from moetier.model.speculative import verify
from moetier.speculation import Controller, StepCost

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-deepseek_v3", "tiny-glm_moe_dsa"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_container(request.param, tmp_path_factory.mktemp("spec") / request.param, 0)


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Engine]:
    with Engine.open(model, budget="100%") as e:
        yield e


def prompt(seed: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(7, 500, n)]


def run(e: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list[tuple[int, str | None]]:
    return [(g.token, g.finish_reason) for g in e.generate(ids, params)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_bit_identical_to_plain_decoding(model: Path, plain: Engine, k: int) -> None:
    with Engine.open(model, budget="100%", speculative=k, fixed_k=True) as spec:
        for s in range(16):
            ids = prompt(s, 6 + s % 17)
            assert run(spec, ids) == run(plain, ids), s
        st = spec.spec_stats
        assert st.drafted > 0 and st.accepted > 0 and st.accepted < st.drafted  # both outcomes happened
        assert st.tokens_per_forward > 1.3  # drafts really were accepted (not one token per forward)
        assert max(st.k_chosen) == k and st.k_chosen[k] > sum(st.k_chosen.values()) // 2  # fewer only near the end


def test_logprobs_stops_and_length_are_those_of_plain_decoding(model: Path, plain: Engine) -> None:
    with Engine.open(model, budget="100%", speculative=3, fixed_k=True) as spec:
        for s in range(4):
            ids = prompt(100 + s)
            ref = list(plain.generate(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
            stop = ref[7 + s % 9].token  # a token the greedy continuation produces: stops there
            for params in (SamplingParams(temperature=0, max_tokens=13 + s, ignore_eos=True, logprobs=True,
                                          top_logprobs=3),
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)),
                           SamplingParams(temperature=0, max_tokens=1 + s % 3, ignore_eos=True),
                           SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.7, presence_penalty=0.3,
                                          ignore_eos=True)):
                a = list(spec.generate(ids, params))
                b = list(plain.generate(ids, params))
                assert [(g.token, g.finish_reason, g.logprob, g.top_logprobs) for g in a] == [
                    (g.token, g.finish_reason, g.logprob, g.top_logprobs) for g in b], (s, params)


def test_prefix_cache_holds_only_accepted_positions(model: Path, plain: Engine, tmp_path: Path) -> None:
    """The KV a speculative sequence leaves (rejected drafts rolled back) is the plain one: a later
    turn reusing it decodes the same tokens, in the same engine and after a restart."""
    base = prompt(7, 30)
    with Engine.open(model, budget="100%", speculative=3, fixed_k=True, prefix_cache="64MiB",
                     prefix_dir=tmp_path) as spec:
        out = [t for t, _ in run(spec, base)]
        assert out == [t for t, _ in run(plain, base)]
        turn = [*base, *out, *prompt(8, 5)]
        gen = spec.generate(turn, GREEDY)
        got = [g.token for g in gen]
        assert gen.cached_tokens == len(base) + len(out) - 1 and got == [t for t, _ in run(plain, turn)]
        assert spec.spec_stats.drafted > spec.spec_stats.accepted > 0
    with Engine.open(model, budget="100%", speculative=3, fixed_k=True, prefix_cache="64MiB",
                     prefix_dir=tmp_path) as again:
        turn2 = [*turn, *got, *prompt(9, 4)]
        gen = again.generate(turn2, GREEDY)
        assert [g.token for g in gen] == [t for t, _ in run(plain, turn2)] and gen.cached_tokens > len(turn)


def test_sampling_keeps_the_target_distribution(model: Path, plain: Engine) -> None:
    """At temperature 1.5 (top-k 3, so the joint support of two tokens is 9 pairs) the first two
    generated tokens of 800 seeded speculative runs follow the exact distribution the model gives
    (chi-square, p > 0.001). The second token is the verified one: drafted after the first,
    accepted with min(1, p/q) or resampled from the residual. (One architecture is enough: the
    verifier does not know which produced the logits.)"""
    if "dsa" in model.name:
        pytest.skip("the verifier is the same for every architecture; measured on tiny-deepseek_v3")
    ids = prompt(3)
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    exact = joint_distribution(plain, ids, params)
    runs = 800
    with Engine.open(model, budget="100%", speculative=1, fixed_k=True) as spec:
        counts: dict[tuple[int, int], int] = {}
        for seed in range(runs):
            toks = [g.token for g in spec.generate(ids, SamplingParams(**{**params.__dict__, "seed": seed}))]
            pair = (toks[0], toks[1])
            counts[pair] = counts.get(pair, 0) + 1
        st = spec.spec_stats
        assert st.drafted >= runs and 0.2 * st.drafted < st.accepted < st.drafted
    assert set(counts) <= set(exact)
    assert chi_square_p(counts, exact) > 1e-3


def joint_distribution(e: Engine, ids: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(y1, y2) from the model itself: the processed distribution of y1, then of y2 given each y1."""
    m = e.model
    cache = m.new_cache()
    first = m.step([(cache, np.asarray(ids))])[0]
    p1 = logits_to_probs(first, params.temperature, params.top_k, params.top_p)
    out = {}
    for y1 in np.flatnonzero(p1):
        c = m.new_cache()
        m.step([(c, np.asarray(ids))])
        p2 = logits_to_probs(m.step([(c, [int(y1)])])[0], params.temperature, params.top_k, params.top_p)
        for y2 in np.flatnonzero(p2):
            out[(int(y1), int(y2))] = float(p1[y1] * p2[y2])
    return out


def chi_square_p(counts: dict[tuple[int, int], int], exact: dict[tuple[int, int], float]) -> float:
    from math import exp, lgamma, log

    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    dof = len(exact) - 1
    # survival function of chi-square(dof) at stat: the regularized upper gamma Q(dof/2, stat/2)
    a, x = dof / 2, stat / 2
    if x <= 0:
        return 1.0
    term = total = 1.0 / a  # series for the lower gamma P(a, x)
    for i in range(1, 500):
        term *= x / (a + i)
        total += term
    lower = exp(a * log(x) - x - lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_rejection_sampling_step_keeps_p_and_refuses_q() -> None:
    """One verify position on fixed p and q: accept-or-resample draws follow p (not q)."""
    v = 6
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=np.float32))
    q = np.array([0.05, 0.05, 0.1, 0.1, 0.3, 0.4])
    p = logits_to_probs(logits, 1.0)
    hist = np.zeros(v)
    draft_rng = np.random.default_rng(1)
    for seed in range(6000):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed, max_tokens=5), v)
        d = int(draft_rng.choice(v, p=q))
        tok, _ = s.verify(logits, d, q)
        hist[tok.token] += 1
    freq = hist / hist.sum()
    assert np.abs(freq - p).max() < 0.025
    assert np.abs(freq - q).max() > 0.2


def test_verify_stops_at_the_first_rejection_and_at_a_finish() -> None:
    v = 8
    logits = np.full((4, v), -5.0, dtype=np.float32)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 5.0  # greedy: 3, 4, 5, then the bonus 6
    s = Sampler(SamplingParams(temperature=0, max_tokens=50), v)
    r = verify(s, logits, [3, 4, 5], [None] * 3, lambda t: None)
    assert [t.token for t in r.tokens] == [3, 4, 5, 6] and r.accepted == 3
    s = Sampler(SamplingParams(temperature=0, max_tokens=50), v)
    r = verify(s, logits, [3, 1, 5], [None] * 3, lambda t: None)
    assert [t.token for t in r.tokens] == [3, 4] and r.accepted == 1  # 1 rejected: 4 chosen instead
    s = Sampler(SamplingParams(temperature=0, max_tokens=2), v)
    r = verify(s, logits, [3, 4, 5], [None] * 3, lambda t: s.finish_reason(t.token))
    assert [t.token for t in r.tokens] == [3, 4] and r.reasons == [None, "length"]


def cost(rows: int, drafts: int, union: int, misses: int, experts_s: float, mtp_s: float = 0.0002) -> StepCost:
    """A memory-bound step: the dense part costs about the same for 1 or 2 rows."""
    return StepCost(rows=rows, sequences=1 if drafts else 0, drafts=drafts, dense_s=0.010 + 0.0002 * rows,
                    experts_s=experts_s, mtp_s=mtp_s if drafts else 0.0, mtp_steps=max(drafts, 1) if drafts else 0,
                    union=union, misses=misses)


def test_controller_turns_drafting_off_when_misses_make_it_a_loss() -> None:
    """Same acceptance (50%), two machines: where the widened union's extra experts are disk reads
    (a step of 2 rows reads 75% more experts than one of 1: 1.5 tokens for 1.75x the time),
    drafting loses and the controller turns it off; where they are resident it drafts."""
    for disk_s, want_on in ((0.0, True), (0.02, False)):
        c = Controller(3, moe_layers=10, experts=64, top_k=4)
        for i in range(40):
            drafts = i % 2
            rows = 1 + drafts
            union = 10 * (4 if rows == 1 else 7)
            misses = union // 2
            c.observe_step(cost(rows, drafts, union, misses, experts_s=0.002 + 2e-5 * union + disk_s * misses))
            if drafts:
                c.observe_verify(1, 1 if i % 4 == 1 else 0)  # 50% acceptance
        d = c.decide(1, 0)
        assert (d.k > 0) == want_on, (disk_s, d)
        if not want_on:
            assert d.reason == "cost" and d.expected_tokens_per_s[0] > max(d.expected_tokens_per_s[k] for k in (1, 2, 3))
            # while off, it probes now and then so its figures stay measured
            ks = [c.decide(1, 0).k for _ in range(40)]
            assert 0 < sum(ks) < 5


def test_controller_probes_more_drafts_and_climbs_to_what_pays() -> None:
    """A head whose drafts are always accepted, on a machine where each draft row costs 0.4x a
    plain step: at the prior acceptance (0.5) of the positions it never drafted, k = 1 pays best;
    at their true acceptance, k_max does. The controller starts from k = 1 (all it measured),
    probes k + 1 now and then, and ends at k_max once the later positions are measured."""
    c = Controller(3, moe_layers=10, experts=64, top_k=4)
    chosen = []
    for _ in range(200):
        d = c.decide(1, 0)
        chosen.append(d.k)
        rows = 1 + d.k
        union = 10 * min(64, 4 + 3 * d.k)
        c.observe_step(cost(rows, d.k, union, 0, experts_s=0.002 + 3.3e-4 * union))
        if d.k:
            c.observe_verify(d.k, d.k)
    first = chosen.index(2)  # the first probe of a second draft, after a stretch at k = 1
    assert 2 not in chosen[:first] and chosen[first - 10 : first] == [1] * 10, chosen
    assert chosen[-20:] == [3] * 20, chosen
    assert c.drafted[2] > 0 and c.acceptance[2] == 1.0


def test_controller_reasons() -> None:
    assert Controller(0, moe_layers=1, experts=8, top_k=2).decide(1, 0).reason == "disabled"
    assert Controller(3, moe_layers=1, experts=8, top_k=2, has_mtp=False).decide(1, 0).reason == "no_mtp"
    fresh = Controller(3, moe_layers=1, experts=8, top_k=2)
    first = [fresh.decide(1, 0) for _ in range(2)]
    assert first[0].k == 1  # no measurements yet: it measures both kinds of step
    with pytest.raises(ValueError, match=">= 0"):
        Controller(-1, moe_layers=1, experts=8, top_k=2)
