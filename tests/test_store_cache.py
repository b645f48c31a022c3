"""Cache policies offline: Belady is optimal, traces round-trip, learned >= LRU, the bench commands run."""

from __future__ import annotations

import functools
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.errors import FormatError
from moetier.store.policy import POLICIES, make_policy
from moetier.store.sim import belady, simulate
from moetier.store.trace import (
    SynthSpec,
    Trace,
    TraceRecorder,
    load_trace,
    save_trace,
    temporal_trace,
    zipf_trace,
)


def _trace(groups: list[list[int]], layer: int = 0) -> Trace:
    return [[(layer, np.array(g, dtype=np.int32))] for g in groups]


def _brute_force(groups: list[list[int]], cap: int) -> int:
    """Most hits any eviction choice achieves (exhaustive; tiny traces only)."""

    @functools.cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(groups):
            return 0
        g = set(groups[i])
        hits = len(g & resident)
        missing = g - resident
        need = len(resident) + len(missing) - cap
        candidates = sorted(resident - g)
        out = -1
        for drop in itertools.combinations(candidates, max(need, 0)):
            out = max(out, best(i + 1, (resident - set(drop)) | g))
        return hits + out

    return best(0, frozenset())


def test_belady_hand_example() -> None:
    assert belady(_trace([[0], [1], [2], [0], [1], [3], [0]]), 2) == (2, 7)


def test_belady_is_optimal_and_bounds_every_policy() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        cap = int(rng.integers(2, 4))
        groups = [sorted(set(rng.integers(0, 5, size=int(rng.integers(1, cap + 1))).tolist())) for _ in range(9)]
        tr = _trace(groups)
        h, _ = belady(tr, cap)
        assert h == _brute_force(groups, cap)
        for p in POLICIES:
            assert simulate(make_policy(p, [0], 5, cap), tr, cap)[0] <= h


def test_trace_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    tr = zipf_trace(SynthSpec(layers=3, n_experts=16, top_k=2, batch=3, steps=5), seed=1)
    save_trace(tmp_path / "t.npz", tr, 16)
    back, n = load_trace(tmp_path / "t.npz")
    assert n == 16 and len(back) == 5
    for a, b in zip(tr, back, strict=True):
        assert [(la, ia.reshape(-1).tolist()) for la, ia in a] == [(lb, ib.tolist()) for lb, ib in b]
    save_trace(tmp_path / "bad.npz", tr, 4)  # ids beyond n_experts
    with pytest.raises(FormatError, match="outside"):
        load_trace(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(FormatError):
        load_trace(tmp_path / "junk.npz")


def test_learned_at_least_lru_on_synthetic_traces() -> None:
    spec = SynthSpec(layers=6, n_experts=32, top_k=4, batch=2, steps=250)
    for gen in (zipf_trace, temporal_trace):
        tr = gen(spec, 1)
        for frac in (0.1, 0.25, 0.5):
            cap = int(frac * spec.layers * spec.n_experts)
            lru = simulate(make_policy("lru", range(6), 32, cap), tr, cap)[0]
            learned = simulate(make_policy("learned", range(6), 32, cap), tr, cap)[0]
            assert learned >= lru, (gen.__name__, frac)


def test_trace_recorder_on_the_model(tmp_path: Path) -> None:
    from moetier.convert import synth
    from moetier.model.experts import DictExperts
    from moetier.model.forward import Model
    from moetier.model.ops import ReferenceOps
    from moetier.weights.container import Container

    with Container.open(synth.write_container("tiny-olmoe", tmp_path / "m", 0)) as c:
        ops = ReferenceOps()
        experts = {(li, e): c.read_expert(li, e) for li in c.args.moe_layer_ids for e in range(8)}
        rec = TraceRecorder(DictExperts(experts, ops))
        model = Model(c.args, {n: c.dense(n) for n in c.dense_names()}, ops, rec)
        cache = model.new_cache()
        model.step([(cache, np.arange(5))])
        model.step([(cache, np.array([7]))])
    assert len(rec.trace) == 2 and [layer for layer, _ in rec.trace[1]] == c.args.moe_layer_ids
    assert rec.trace[0][0][1].shape == (5, c.args.num_experts_per_tok)
    save_trace(tmp_path / "r.npz", rec.trace, 8)
    assert len(load_trace(tmp_path / "r.npz")[0]) == 2


def test_bench_cache_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tr = temporal_trace(SynthSpec(layers=4, n_experts=16, top_k=2, batch=2, steps=60), seed=2)
    save_trace(tmp_path / "routing.npz", tr, 16)
    assert main(["bench", "cache", "--json", "--trace", str(tmp_path / "routing.npz"), "--steps", "40",
                 "--layers", "4", "--experts", "16", "--top-k", "2", "--batch", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in out["traces"]] == ["routing", "zipf", "temporal"]
    assert out["ratio_trace"] == "routing" and 0 < out["ratio"] <= 1
    for t in out["traces"]:
        for p in ("lru", "lfu", "learned"):
            assert all(a <= b + 1e-12 for a, b in zip(t["hit_rate"][p], t["hit_rate"]["belady"], strict=True))


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_bench_io_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "io", "--json", "--dir", str(tmp_path), "--record-bytes", "65536", "--set-records", "32",
                 "--records", "16", "--rounds", "2", "--depth", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["record_bytes"] == 65536 and len(out["rounds"]) == 2 and out["ratio"] > 0
    assert out["checksum_failures"] == 0


@pytest.mark.parametrize("capacity", [64, 40], ids=["holds-every-key", "evicts"])
def test_learned_policy_without_replaying_shadows_that_never_evict_decides_the_same(capacity: int) -> None:
    """An adaptive learned policy whose shadow caches hold every sampled key leaves them out
    (they tie, so the fraction never moves); one replaying them anyway, fed the same accesses,
    must keep the same fraction and the same hot and cold lists throughout. Where the shadows
    do evict (capacity 40 of 64 keys) both keep them and still agree."""
    from moetier.store.policy import FRACTIONS, Learned, _Shadow

    layers, n = [0, 1], 32
    fast = Learned(layers, n, capacity, refresh_every=16, choose_every=64)
    slow = Learned(layers, n, capacity, refresh_every=16, choose_every=64)
    if capacity >= 2 * n:
        assert not fast._shadows  # left out
        slow._shadows = [_Shadow(f, round(slow._rate * slow.capacity)) for f in FRACTIONS]
    else:
        assert fast._shadows
    rng = np.random.default_rng(5)
    popular = rng.permutation(n)
    resident: set[tuple[int, int]] = set()
    for step in range(400):
        layer = step % 2
        union = {(layer, e) for e in popular[np.minimum(rng.geometric(0.15, 6) - 1, n - 1)].tolist()}
        for p in (fast, slow):
            for k in sorted(union):
                p.record(k)
        while len(resident | union) > capacity:  # room for the union's new keys, as the tier makes it
            victims = [p.victim(union.__contains__) for p in (fast, slow)]
            assert victims[0] == victims[1] and victims[0] is not None
            for p in (fast, slow):
                p.remove(victims[0])
            resident.discard(victims[0])
        for k in sorted(union - resident):
            for p in (fast, slow):
                p.insert(k)
        resident |= union
        assert fast.fraction == slow.fraction
        assert list(fast._hot) == list(slow._hot) and list(fast._cold) == list(slow._cold)
