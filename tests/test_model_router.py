"""Router choice rules and RoPE properties, checked on hand-made numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moetier.model.config import ModelArgs
from moetier.model.rope import Rope, softmax_scale, yarn_mscale
from moetier.model.router import select_experts

BASE = ModelArgs(arch="test", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                 rope_dim=8, moe_layers=(True,), n_routed_experts=8, num_experts_per_tok=2)


def args(**kw: object) -> ModelArgs:
    return dataclasses.replace(BASE, **kw)  # type: ignore[arg-type]


def test_plain_top_k_with_renorm_and_scaling() -> None:
    s = np.array([[0.05, 0.3, 0.1, 0.2, 0.05, 0.1, 0.1, 0.1]], np.float32)
    ids, w = select_experts(s, None, args())
    assert ids.tolist() == [[1, 3]] and ids.dtype == np.int32
    np.testing.assert_allclose(w, [[0.3, 0.2]])
    _, w = select_experts(s, None, args(norm_topk_prob=True, routed_scaling_factor=2.0))
    np.testing.assert_allclose(w, [[1.2, 0.8]], rtol=1e-6)


def test_correction_bias_moves_the_choice_not_the_weights() -> None:
    s = np.array([[0.9, 0.8, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]], np.float32)
    bias = np.array([0, 0, 0, 1.0, 0, 0, 0, 0], np.float32)
    ids, w = select_experts(s, bias, args())
    assert ids.tolist() == [[3, 0]]
    np.testing.assert_allclose(w, [[0.1, 0.9]])


def test_group_limit_top2_sum_vs_max() -> None:
    # groups of two: g0 = (0.50, 0.00) max .50 sum .50; g1 = (0.45, 0.40) max .45 sum .85;
    # g2 = (0.30, 0.30) max .30 sum .60; g3 = (0.48, 0.01) max .48 sum .49
    s = np.array([[0.50, 0.00, 0.45, 0.40, 0.30, 0.30, 0.48, 0.01]], np.float32)
    grouped = {"n_group": 4, "topk_group": 2}
    ids, _ = select_experts(s, None, args(group_score="top2_sum", **grouped))  # groups 1, 2
    assert ids.tolist() == [[2, 3]]
    ids, _ = select_experts(s, None, args(group_score="max", **grouped))  # groups 0, 3
    assert ids.tolist() == [[0, 6]]
    ids, _ = select_experts(s, None, args())  # no groups
    assert ids.tolist() == [[0, 6]]


def test_ties_break_towards_the_lower_id() -> None:
    s = np.full((1, 8), 0.125, np.float32)
    ids, _ = select_experts(s, None, args(num_experts_per_tok=3))
    assert ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_scores_depend_on_relative_position_only(interleave: bool) -> None:
    rope = Rope.from_args(args(rope_interleave=interleave))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope.cos_sin(np.array([pq]))
        ck, sk = rope.cos_sin(np.array([pk]))
        return float((rope.apply(q, cq, sq) * rope.apply(k, ck, sk)).sum())

    assert score(7, 3) == pytest.approx(score(14, 10), rel=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
    assert score(5, 5) == pytest.approx(float((q * k).sum()), rel=1e-5)


def test_partial_rotary_passes_the_tail_through() -> None:
    rope = Rope.from_args(args(rope_dim=4))
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 8)
    c, s = rope.cos_sin(np.array([3]))
    np.testing.assert_array_equal(rope.apply(x, c, s)[..., 4:], x[..., 4:])


def test_yarn_scales() -> None:
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    mla = args(attention="mla", q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=8, rope_dim=8, rope_scaling=yarn, max_position_embeddings=163840)
    m = yarn_mscale(40.0, 1.0)
    assert softmax_scale(mla) == pytest.approx(16**-0.5 * m * m)
    assert Rope.from_args(mla).attention_factor == pytest.approx(1.0)
    gqa = args(rope_scaling=yarn)
    assert softmax_scale(gqa) == pytest.approx(8**-0.5)  # GQA models leave the softmax scale alone
    inv = Rope.from_args(mla).inv_freq
    plain = Rope.from_args(dataclasses.replace(mla, rope_scaling=None)).inv_freq
    assert inv[0] == pytest.approx(plain[0]) and inv[-1] == pytest.approx(plain[-1] / 40.0)
    with pytest.raises(ValueError, match="rope type"):
        Rope.from_args(args(rope_scaling={"rope_type": "longrope"}))
