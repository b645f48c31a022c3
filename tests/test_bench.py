"""The benchmark commands run end to end on the tiny synth model with tiny sizes and print one
JSON object with their documented keys; the benchmark model is built once and reused.
Smoke tests only: figures are measured by `moetier bench ...`, never asserted here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier.bench import models
from moetier.cli import main
from moetier.errors import InvalidArgument
from moetier.settings import load_settings

pytestmark = pytest.mark.timeout(60)

TINY = "tiny-deepseek_v3"
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    cfg = root / "cfg.yml"
    cfg.write_text(f"data_dir: {root / 'data'}\n")
    return cfg


@pytest.fixture(scope="module")
def tiny(config: Path) -> Path:
    return models.benchmark_model(TINY, load_settings(config), say=False)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(argv) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_benchmark_model_built_once_then_reused(config: Path, tiny: Path) -> None:
    settings = load_settings(config)
    assert tiny == settings.data_path / "models" / TINY and models.is_complete(tiny)
    stamp = (tiny / "moetier.json").stat().st_mtime_ns
    assert models.benchmark_model(TINY, settings, say=False) == tiny
    assert (tiny / "moetier.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert not list(tiny.parent.glob(f".{TINY}.tmp-*"))  # no build left behind


def test_benchmark_model_rebuilds_an_interrupted_build_and_refuses_another_preset(tmp_path: Path) -> None:
    settings = load_settings(overrides={"data_dir": str(tmp_path)}, environ={})
    half = tmp_path / "models" / "tiny-olmoe"
    half.mkdir(parents=True)
    (half / "leftover").write_text("an interrupted build")
    built = models.benchmark_model("tiny-olmoe", settings, say=False)
    assert models.is_complete(built) and not (built / "leftover").exists()
    shutil.copytree(built, tmp_path / "models" / "tiny-mixtral")
    with pytest.raises(InvalidArgument, match="tiny-olmoe"):
        models.benchmark_model("tiny-mixtral", settings, say=False)


def test_prompt_ids_are_shipped_text(tiny: Path) -> None:
    from moetier.text.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(tiny)
    ids = models.prompt_ids(tok, 3000)
    assert len(ids) == 3000 and ids[:50] == tok.encode(models.shipped_text(0))[:50]


@needs_fio
def test_bench_io_on_a_model(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "io", "--json", "--model", str(tiny), "--records", "8", "--rounds", "2",
                          "--depth", "2"])
    assert {"ratio", "store_gbps", "fio_gbps", "record_bytes", "rounds", "target"} <= set(r)
    assert r["source"] == f"container {tiny}" and len(r["rounds"]) == 2 and r["checksum_failures"] == 0


def test_bench_compute_on_a_model(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "compute", "--json", "--model", str(tiny), "--working-set-mb", "2",
                          "--copy-mb", "8", "--rounds", "1", "--batch", "1", "--ref-experts", "1"])
    assert r["ratio"] == pytest.approx(r["batch"]["1"]["fraction_of_memory"])
    assert r["expert"]["hidden"] == 64 and r["memory_gbps"] > 0


def test_bench_compute_default_shape_is_the_benchmark_models() -> None:
    from moetier.bench.compute import preset_shape
    from moetier.convert.synth import preset_args

    a = preset_args(models.BENCHMARK_PRESET)
    s = preset_shape()
    assert (s.hidden, s.intermediate, s.dtype, s.group_size) == (a.hidden_size, a.moe_intermediate_size, "int4", 64)


def test_bench_cache_records_model_traces_once(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "cache", "--json", "--model", str(tiny), "--prompt-tokens", "24", "--tokens", "8",
            "--steps", "30", "--layers", "3", "--experts", "16", "--top-k", "2", "--batch", "2"]
    r = run_json(capsys, argv)
    assert [t["name"] for t in r["traces"]] == [TINY, f"{TINY} decode", "zipf", "temporal"]
    full, dec = r["traces"][:2]
    # the decode steps alone: one token's top-k per layer, without the prompt's prefill steps
    assert 0 < dec["steps"] < full["steps"] and dec["mean_union"] < full["mean_union"]
    assert dec["accesses"] == dec["steps"] * dec["layers"] * dec["mean_union"]
    assert min(dec["capacity"]) <= min(full["capacity"])
    assert r["ratio_trace"] == TINY and 0 < r["ratio"] <= 1 and r["ratio_policy"] in ("lru", "lfu", "learned")
    assert isinstance(r["learned_ge_lru"], bool)
    for t in r["traces"]:
        assert set(t["hit_rate"]) == {"lru", "lfu", "learned", "learned+history", "belady"}
        assert all(len(v) == len(r["sizes"]) for v in t["hit_rate"].values())
    files = sorted(tiny.parent.glob(f"{TINY}.routing-p24-g8-*.npz"))
    assert len(files) == len(models.TRACE_TEXTS)  # kept next to the model
    stamps = [f.stat().st_mtime_ns for f in files]
    assert run_json(capsys, argv)["traces"][0]["accesses"] == r["traces"][0]["accesses"]
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read back, not recorded again


@needs_fio
@pytest.mark.timeout(240)  # two clusters of three service processes each, started as `moetier up` starts them
def test_bench_e2e_json(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "e2e", "--json", "--model", str(tiny), "--budget", "100%", "--tokens", "3",
                          "--prompt-tokens", "6", "--rounds", "2", "--fio-records", "4", "--copy-mb", "8",
                          "--probe-calls", "5"])
    assert {"hop_overhead", "ratio", "target", "tokens_match", "fio_gbps", "memory_gbps", "engine", "cluster",
            "rounds", "dense_step_bytes", "record_bytes"} <= set(r)
    assert r["ratio"] == r["hop_overhead"] > 0 and len(r["hop_overhead_rounds"]) == 2
    assert r["tokens_match"] is True  # temperature 0: the cluster computes the engine's tokens
    assert [x["order"] for x in r["rounds"]] == [["engine", "cluster"], ["cluster", "engine"]]
    for kind in ("engine", "cluster"):
        for phase in ("cold", "warm"):
            p = r[kind][phase]
            for key in ("ttft_s", "decode_tok_s", "s_per_token", "bound_s", "disk_bound_s", "memory_bound_s",
                        "hit_rate", "missed_mb_per_token", "touched_mb_per_token", "prefetch_recall", "expert_s",
                        "read_wait_s", "rest_s", "cpu_busy", "machine_busy", "cpu_wait", "cpu_s_per_token"):
                assert set(p[key]) == {"median", "min", "max"}, key
            assert p["touched_mb_per_token"]["min"] > 0
            assert p["cpu_busy"]["min"] >= 0  # CPU seconds / (decode seconds x CPUs), in clock ticks
            assert p["machine_busy"]["min"] >= 0 and p["cpu_wait"]["min"] >= 0
            assert p["cpu_s_per_token"]["min"] >= 0
    # CPU time is read in clock ticks (10 ms): three tokens of the tiny model may take under a tick
    # in one phase of one round, never in all of them -- a decode step computes.
    assert max(r[k][ph]["cpu_s_per_token"]["max"] for k in ("engine", "cluster") for ph in ("cold", "warm")) > 0
    hops = r["cluster"]["warm"]["hops"]
    assert set(hops) == {"worker_step_s", "store_s", "store_load_s", "call_s", "rpc_hop_s", "rpc_hop_per_call_s",
                         "calls_per_token", "stream_hop_s"}
    assert r["local_lane"] is True  # the worker's default: the store is on this host
    probe = r["probe"]  # the round trip over both transports, beside the store's own time
    assert {"grpc_round_trip_s", "grpc_hop_s", "lane_round_trip_s", "lane_hop_s"} <= set(probe)
    assert probe["grpc_round_trip_s"]["min"] > probe["grpc_store_s"]["min"] > 0


@needs_fio
@pytest.mark.timeout(300)  # three systems: the engine, one store's cluster, two stores' cluster
def test_bench_e2e_stores_2(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "e2e", "--json", "--model", str(tiny), "--budget", "100%", "--tokens", "3",
                          "--prompt-tokens", "6", "--rounds", "1", "--fio-records", "4", "--copy-mb", "8",
                          "--probe-calls", "0", "--stores", "2"])
    assert [x["order"] for x in r["rounds"]] == [["engine", "cluster", "sharded"]]
    assert r["tokens_match"] is True  # two stores compute one store's tokens
    sh = r["sharded"]
    assert sh["stores"] == 2 and sh["decode_tok_s_over_one_store"] > 0
    assert set(sh["read_mb_per_trial"]) == {"store-0-0", "store-0-1"} == set(sh["read_mb_per_decode_token"])
    # each store holds half the layers' files and reads its own experts: both read, together what one store reads
    assert all(v["min"] > 0 for v in sh["read_mb_per_trial"].values())
    assert set(sh["one_store_read_mb_per_trial"]) == {"store-0"}
    assert sh["warm"]["decode_tok_s"]["min"] > 0


def test_shard_dirs_split_the_layer_files(tiny: Path, tmp_path: Path) -> None:
    from moetier.bench._cluster import shard_dirs

    a, b = shard_dirs(tiny, tmp_path, 2)
    files = sorted(p.name for p in (tiny / "experts").glob("*.bin"))
    assert sorted(p.name for p in (a / "experts").glob("*.bin")) == files[0::2]
    assert sorted(p.name for p in (b / "experts").glob("*.bin")) == files[1::2]
    for d in (a, b):  # everything else is there, the same files (hard links on one filesystem)
        assert (d / "moetier.json").read_bytes() == (tiny / "moetier.json").read_bytes()
        assert sorted(p.name for p in (d / "dense").iterdir()) == sorted(p.name for p in (tiny / "dense").iterdir())


def test_machine_busy_counts_this_process_among_the_others() -> None:
    import time

    from moetier.bench._cluster import machine_busy_s

    m0, c0 = machine_busy_s(), time.process_time()
    while time.process_time() - c0 < 0.3:  # this thread busy on one of the CPUs
        pass
    dm, dc = machine_busy_s() - m0, time.process_time() - c0
    assert dm >= 0.5 * dc  # the machine's busy seconds include this process's (others' come on top)
    assert machine_busy_s(set()) == 0.0  # no CPUs, no busy seconds


def test_process_wait_sums_its_threads() -> None:
    import os
    import threading

    from moetier.bench._cluster import process_wait_s

    if not os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("this kernel keeps no schedstat")
    before = process_wait_s(os.getpid())
    assert before >= 0 and process_wait_s(os.getpid()) >= before  # monotonic over the live threads
    assert process_wait_s(2**22 + 1) == 0.0  # no such process: nothing waited


@needs_fio
def test_bench_spec_json(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "spec", "--json", "--model", str(tiny), "--budgets", "100%,25%", "--tokens", "5",
                          "--prompt-tokens", "6", "--requests", "2", "--rounds", "2", "--k", "2", "--fio-records", "4"])
    assert r["k"] == 2 and set(r["budgets"]) == {"100%", "25%"}
    for b in r["budgets"].values():
        assert b["tokens_match"] is True  # temperature 0: drafts never change a token
        assert set(b["modes"]) == {"off", "auto", "fixed"}
        off, fixed = b["modes"]["off"], b["modes"]["fixed"]
        assert off["tokens_per_forward"] == 1 and off["acceptance"] is None
        assert fixed["acceptance"] is not None and len(fixed["acceptance_by_position"]) == 2
        assert fixed["steps_by_k"].get("2", 0) > 0  # fixed k drafts k whenever there is room
        for m in b["modes"].values():
            assert len(m["tok_s"]) == 2 and m["bound_s"] > 0 and m["memory_bound_s"] > 0


def test_bench_spec_refuses_a_model_without_mtp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moetier.convert.synth import write_container

    path = tmp_path / "nomtp"
    write_container(TINY, path, 0, mtp=None)
    assert main(["bench", "spec", "--model", str(path)]) == 1
    assert "has no MTP head" in capsys.readouterr().err


def test_bench_cache_decode_only_drops_prefill_steps() -> None:
    from moetier.bench.cache import decode_only

    def ids(*e: int) -> np.ndarray:
        return np.array(e, dtype=np.int32)

    prefill = [(1, ids(0, 1, 2, 3, 1)), (2, ids(4, 5, 6))]
    decode = [[(1, ids(3, 1)), (2, ids(6, 2))], [(1, ids(0, 2)), (2, ids(5, 7))]]
    mixed = [(1, ids(0, 1)), (2, ids(0, 1, 2))]  # one layer with a batch union: not a decode step
    got = decode_only([prefill, decode[0], mixed, decode[1]])
    assert [[(la, i.tolist()) for la, i in s] for s in got] == [[(la, i.tolist()) for la, i in s] for s in decode]
    assert decode_only([]) == []


@pytest.mark.skipif(not __import__("moetier.kernels", fromlist=["c_available"]).c_available(),
                    reason="the int8-activation kernels are C only")
def test_bench_activations_json(config: Path, tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, ["bench", "activations", "--json", "--config", str(config), "--presets", TINY,
                          "--model", str(tiny), "--tokens", "24", "--prompt-tokens", "8", "--generate", "4"])
    assert [row["model"] for row in r["rows"]] == ["demo", TINY, tiny.name]
    demo, synth, given = r["rows"]
    assert demo["kind"] in ("trained", "synth") and synth["kind"] == "synth" and given["kind"] == "given"
    assert r["ratio"] == demo["top1"]
    for row in r["rows"]:
        assert row["positions"] == 24 and row["greedy_tokens"] == 4 and 0 <= row["greedy_equal"] <= 4
        assert not row["identical"]  # int8 activations are another computation: the bits differ
        assert 0 < row["rel_rms"] < 0.5 and row["max_abs"] > 0 and row["kl"] >= 0 and 0 <= row["top1"] <= 1
    assert synth["top1"] == given["top1"] and synth["rel_rms"] == given["rel_rms"]  # the same container


def test_bench_activations_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from moetier.bench.activations import compare, first_difference

    rng = np.random.default_rng(3)
    exact = rng.standard_normal((5, 11)).astype(np.float32)
    same = compare(exact, exact.copy())
    assert same == {"top1": 1.0, "rel_rms": 0.0, "max_abs": 0.0, "kl": 0.0}
    other = exact.copy()
    top = np.argmax(exact, axis=1)
    other[0, (top[0] + 1) % 11] = exact[0, top[0]] + 1.0  # row 0's arg max moves, by 1 + a gap
    f = compare(exact, other)
    assert f["top1"] == 0.8 and f["max_abs"] >= 1.0 and f["kl"] > 0 and 0 < f["rel_rms"] < 1
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1], [1]) == 1
    assert first_difference([], [1]) == 0
    assert main(["bench", "activations", "--tokens", "0"]) != 0
    assert "--tokens must be at least 1" in capsys.readouterr().err
