"""The performance model (moetier/perf.py), the simulator (moetier/simulate.py) and `moetier plan`:
the byte counts agree with a real container, the bounds with `bench e2e`'s own arithmetic, the
simulated cache with the offline cache simulator the policies are benchmarked with, and the plan's
placement adds up."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.convert.synth import preset_args, write_container
from moetier.perf import Disk, ModelCosts, Rates, disk_seconds, step_bounds
from moetier.simulate import _Cache, simulate, synthetic_trace
from moetier.store.policy import make_policy
from moetier.store.sim import simulate as cache_sim
from moetier.store.trace import SynthSpec, temporal_trace
from moetier.weights.container import Container


def test_costs_are_the_containers_bytes(tmp_path: Path) -> None:
    m = write_container("tiny-deepseek_v3", tmp_path / "m", 0)
    with Container.open(m) as c:
        costs = ModelCosts.of(c.args, "m", "int4", "int8", 64)
        assert costs.record_bytes == c.layout.record_bytes and costs.expert_bytes == c.expert_bytes
        dense = {n: c.dense(n) for n in c.dense_names()}
        assert costs.dense_bytes == sum(t.nbytes for t in dense.values())
        assert costs.dense_step_bytes == sum(t.nbytes // t.shape[0] if n == "embed" else t.nbytes
                                             for n, t in dense.items())
        assert costs.kv_bytes_per_token == 4 * c.args.num_layers * c.args.kv_cache_width


def test_the_bounds_are_bench_e2es() -> None:
    from moetier.bench.e2e import Counts, phase

    d = Counts(t=2.0, hits=300, misses=60, submitted=80, pf_issued=30, pf_useful=10)
    record, dense, fio, mem = 4 << 20, 100 << 20, 1.7, 19.0
    ph = phase(d, 10, record, dense, fio, mem, 2)
    b = step_bounds(ph.missed_bytes, ph.touched_bytes, Rates((Disk(fio),), mem))
    assert b.disk_s == pytest.approx(ph.disk_bound_s, rel=1e-12)
    assert b.memory_s == pytest.approx(ph.memory_bound_s, rel=1e-12) and b.bound_s == pytest.approx(ph.bound_s)
    assert b.binding == ("disk" if ph.disk_bound_s > ph.memory_bound_s else "memory")


def test_mirrors_split_reads_by_bandwidth() -> None:
    one = disk_seconds(1e9, [Disk(9.0)])
    two = disk_seconds(1e9, [Disk(9.0), Disk(3.0)])
    assert one / two == pytest.approx(12 / 9)  # the seed's 9 + 3 GB/s pair: about +33%
    half = disk_seconds(1e9, [Disk(9.0), Disk(3.0, holds=0.5)])
    assert two < half < one
    # half the records on both (split 3:1), the other half on the primary alone
    assert half == pytest.approx((0.5 * 9 / 12 + 0.5) * 1e9 / 9e9)
    with pytest.raises(ValueError, match="positive"):
        disk_seconds(1.0, [Disk(0.0)])


def test_the_simulated_cache_is_the_offline_simulators() -> None:
    spec = SynthSpec(layers=4, n_experts=32, top_k=4, batch=1, steps=200)
    trace = temporal_trace(spec, seed=3)
    for policy in ("lru", "lfu"):
        for capacity in (8, 40, 100):
            cache = _Cache(policy, list(range(4)), 32, capacity)
            misses = sum(cache.acquire([(layer, int(e)) for e in np.unique(ids)]) for step in trace
                         for layer, ids in step)
            hits, total = cache_sim(make_policy(policy, list(range(4)), 32, capacity), trace, capacity)
            assert total - hits == misses, (policy, capacity)


def test_simulation_phases() -> None:
    costs = ModelCosts.of(preset_args("tiny-qwen3_moe"), "t")
    trace = synthetic_trace(costs, 64, seed=1)
    rates = Rates((Disk(1.0),), 10.0, 2.0)
    every = costs.moe_layers * costs.n_experts
    full = simulate(trace, costs, rates, capacity=every, tokens=16)
    assert full.warm.hit_rate == 1.0 and full.warm.missed_bytes == 0 and full.cold.hit_rate < 1.0
    assert full.warm.binding == "compute" and full.warm.tok_s == pytest.approx(1 / full.warm.compute_s)
    small = simulate(trace, costs, rates, capacity=costs.top_k, tokens=16)
    assert small.warm.hit_rate < full.warm.hit_rate and small.warm.missed_bytes > 0
    assert small.warm.serial_s == pytest.approx(small.warm.disk_s + small.warm.compute_s)
    recalled = simulate(trace, costs, rates, capacity=costs.top_k, tokens=16, recall=1.0)
    assert recalled.warm.expected_s == pytest.approx(recalled.warm.bound_s)
    with pytest.raises(ValueError, match="need 80"):
        simulate(trace, costs, rates, capacity=4, tokens=40)


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["plan", "--json", "--tokens", "8", "--prompt-tokens", "32", "--memory-gbps", "20",
                 "--compute-gbps", "5", "--compute-gbps-batched", "10", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_plan_glm5_placement_and_prediction(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"data_dir: {tmp_path}\n")  # no profile there: the given figures are used
    costs = ModelCosts.of(preset_args("glm-5"), "glm-5")
    code, small = plan_json(capsys, "--preset", "glm-5", "--ram", "25GB", "--disk-gbps", "1", "--config", str(cfg))
    assert code == 0 and small["placement"]["fits"]
    p = small["placement"]
    assert p["dense_bytes"] == costs.dense_bytes and p["kv_bytes"] == 4096 * costs.kv_bytes_per_token
    room = 25 * 10**9 - (2 << 30) - costs.dense_bytes - p["kv_bytes"]
    assert p["experts_cached"] == room // costs.record_bytes
    assert small["machine"]["sources"]["disks"] == "given"
    code, big = plan_json(capsys, "--preset", "glm-5", "--ram", "128GB", "--disk-gbps", "7", "--config", str(cfg))
    assert code == 0 and big["warm"]["hit_rate"] > small["warm"]["hit_rate"]
    assert big["warm"]["tok_s"] > small["warm"]["tok_s"] > 0 and small["cold"]["binding"] in ("disk", "compute")
    code, none = plan_json(capsys, "--preset", "glm-5", "--ram", "16GB", "--disk-gbps", "1", "--config", str(cfg))
    assert code == 1 and not none["placement"]["fits"] and "cold" not in none
    code, text = main(["plan", "--preset", "glm-5", "--ram", "16GB", "--disk-gbps", "1", "--tokens", "8",
                       "--prompt-tokens", "32", "--memory-gbps", "20", "--compute-gbps", "5",
                       "--compute-gbps-batched", "10", "--config", str(cfg)]), capsys.readouterr().out
    assert code == 1 and "does not fit" in text and "dense (resident)" in text


def test_plan_a_container_measures_what_is_not_given(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    m = write_container("tiny-qwen3_moe", tmp_path / "m", 0)
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"data_dir: {tmp_path}\n")
    code = main(["plan", "--json", "--model", str(m), "--config", str(cfg), "--tokens", "8", "--prompt-tokens", "16",
                 "--ram", "4GB"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["machine"]["sources"]["disks"].startswith("measured now")
    assert out["machine"]["disks"][0]["gbps"] > 0 and out["machine"]["compute_gbps"] > 0
    assert out["placement"]["experts_cached"] == out["model"]["moe_layers"] * out["model"]["n_experts"]
    assert out["warm"]["hit_rate"] == 1.0


def test_calibration_replays_the_runs_requests(tmp_path: Path) -> None:
    """A bench e2e run's figures in, the simulator's prediction beside its measurement out."""
    from moetier.commands.simulate import calibrate
    from moetier.simulate import replay_requests

    m = write_container("tiny-qwen3_moe", tmp_path / "m", 0)
    with Container.open(m) as c:
        costs = ModelCosts.of(c.args, "m")
        record = c.layout.record_bytes
    trace = synthetic_trace(costs, 9, seed=2)  # one prompt step, then 8 decode steps

    def system(s: float) -> dict:  # type: ignore[type-arg]
        one = {"s_per_token": {"median": s}, "bound_s": {"median": s / 2}, "hit_rate": {"median": 0.5},
               "prefetch_recall": {"median": 0.25}}
        return {"cold": one, "warm": one}

    run = {"name": "e2e", "_file": "run.json", "model": str(m), "budget_bytes": 6 * record, "policy": "lru",
           "record_bytes": record, "prompt_tokens": 5, "tokens": 9, "fio_gbps": {"median": 1.5},
           "memory_gbps": {"median": 12.0}, "engine": system(0.01), "cluster": system(0.02)}
    rows = calibrate(run, trace)
    assert [(r["system"], r["request"]) for r in rows] == [("engine", "cold"), ("engine", "warm"),
                                                          ("cluster", "cold"), ("cluster", "warm")]
    cold, warm = replay_requests(trace, costs, Rates((Disk(1.5),), 12.0), capacity=6, policy="lru", recall=0.25)
    for r, ph in zip(rows, (cold, warm, cold, warm), strict=True):
        assert r["bound_s"] == ph.bound_s and r["hit_rate"] == ph.hit_rate
        assert r["error_bound"] == pytest.approx(ph.bound_s / r["measured_s"] - 1)
    assert warm.hit_rate >= cold.hit_rate
    with pytest.raises(Exception, match="not the model that run used"):
        calibrate({**run, "record_bytes": record + 4096}, trace)


def test_simulate_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"data_dir: {tmp_path}\n")
    base = ["simulate", "--preset", "mini-glm", "--disk-gbps", "2", "--memory-gbps", "200", "--compute-gbps", "200",
            "--compute-gbps-batched", "10", "--tokens", "8", "--policy", "lru", "--config", str(cfg), "--json"]
    assert main([*base, "--cache", "10%"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert main([*base, "--cache", "100%"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["warm"]["hit_rate"] == 1.0 and small["warm"]["hit_rate"] < 1.0
    assert full["experts_cached"] == 26 * 64 and full["warm"]["tok_s"] > small["warm"]["tok_s"]
