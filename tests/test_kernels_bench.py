"""`moetier bench compute` runs end to end and reports its figures beside the memory read bandwidth and the FMA peak."""

from __future__ import annotations

import json

import pytest

from moetier.cli import main


def test_bench_compute_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "compute", "--json", "--working-set-mb", "12", "--copy-mb", "8", "--rounds", "1",
               "--batch", "1", "3", "--ref-experts", "1", "--threads", "1"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["memory_gbps"] > 0
    assert set(r["batch"]) == {"1", "3"}
    assert r["ratio"] == pytest.approx(r["batch"]["1"]["fast_gbps"] / r["memory_gbps"])
    one = r["batch"]["1"]
    assert one["cached_gbps"] > 0
    assert one["cache_ceiling_of_memory"] == pytest.approx(one["cached_gbps"] / r["memory_gbps"])
    assert r["expert"] == {"hidden": 2048, "intermediate": 1408, "dtype": "int4", "group_size": 64,
                           "bytes": r["expert"]["bytes"], "source": "default (mini-glm)"}
    assert r["working_set_bytes"] >= 12 << 20


def test_bench_compute_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "compute", "--working-set-mb", "10", "--copy-mb", "8", "--rounds", "1", "--batch", "2",
               "--ref-experts", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "memory read bandwidth" in out and "FMA peak" in out and "ReferenceOps" in out
    assert "in cache GB/s" in out and "cache ceiling" in out
