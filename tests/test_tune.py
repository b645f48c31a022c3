"""`moetier tune`: it measures each setting's candidates, refuses one that changes a bit, saves the
profile, and the services take the profile's choices unless a flag, the environment or the config
file sets them; a profile of another machine is ignored."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier import tune as tune_module
from moetier.cli import main
from moetier.convert.synth import write_container
from moetier.errors import DataCorruption
from moetier.kernels.fast import FastOps
from moetier.profile import FILE, Profile, apply_profile, load_profile, profile_path, save_profile
from moetier.settings import load_settings


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_container("tiny-qwen3_moe", tmp_path_factory.mktemp("tune") / "m", 0)


def config(tmp: Path, extra: str = "") -> Path:
    cfg = tmp / "c.yml"
    cfg.write_text(f"data_dir: {tmp / 'data'}\n{extra}")
    return cfg


def test_tune_saves_a_profile(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    assert main(["tune", "--model", str(model), "--config", str(cfg), "--seconds", "0.1", "--tokens", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == str(tmp_path / "data" / FILE)
    settings = load_settings(cfg)
    prof = load_profile(settings)
    assert prof is not None
    got = out["settings"]
    assert set(got) == {"kernel_threads (dense worker)", "storage.queue_depth", "storage.direct_io",
                        "storage.prefetch_depth"}
    assert prof.queue_depth == got["storage.queue_depth"]["chosen"]
    assert prof.prefetch_depth == got["storage.prefetch_depth"]["chosen"]
    assert prof.kernel_threads == got["kernel_threads (dense worker)"]["chosen"]
    for s in got.values():
        assert str(s["chosen"]) in s["figures"] and str(s["default"]) in s["figures"]
        assert s["figures"][str(s["chosen"])] >= max(s["figures"].values()) * 0.95 - 1e-9
    assert prof.memory_gbps and prof.compute_gbps and prof.disk_gbps
    assert main(["tune", "--model", str(model), "--config", str(cfg), "--seconds", "0.1", "--tokens", "3",
                 "--dry-run"]) == 0
    assert "dry run: nothing saved" in capsys.readouterr().out


def test_a_candidate_with_other_bits_is_refused(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Drifting(FastOps):
        def expert_ffn(self, x: Any, w: Any) -> Any:
            y = super().expert_ffn(x, w)
            if self.threads == 1:
                y = y.copy()
                y.view(np.uint32)[0, 0] ^= 1  # one bit
            return y

    monkeypatch.setattr(tune_module, "FastOps", Drifting)
    with pytest.raises(DataCorruption, match="1 threads gives other bits"):
        tune_module.tune_threads(model, 0.05, lambda s: None)


def test_services_take_the_profile_unless_set(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetier.commands.expert_store import build_settings as store_settings
    from services.dense_worker.core import WorkerCore

    cfg = config(tmp_path)
    settings = load_settings(cfg)
    save_profile(settings, Profile(kernel_threads=1, queue_depth=3, direct_io=False, prefetch_depth=7))
    s = apply_profile(settings)
    assert (s.storage.queue_depth, s.storage.direct_io, s.storage.prefetch_depth) == (3, False, 7)
    flags = argparse.Namespace(config=cfg, model=model, budget=None, policy=None, mirror=None, buffered=False,
                               queue_depth=None, router=None, bind=None, metrics_port=None, id=None)
    assert store_settings(flags).storage.queue_depth == 3  # the service command applies it
    flags.queue_depth = 5
    assert store_settings(flags).storage.queue_depth == 5  # a flag wins
    monkeypatch.setenv("MOETIER_STORAGE__PREFETCH_DEPTH", "9")
    assert apply_profile(load_settings(cfg)).storage.prefetch_depth == 9  # the environment wins
    monkeypatch.delenv("MOETIER_STORAGE__PREFETCH_DEPTH")
    assert apply_profile(load_settings(config(tmp_path, "storage: {queue_depth: 6}\n"))).storage.queue_depth == 6
    worker = load_settings(cfg, {"model": {"path": str(model)}, "expert_store": {"address": "127.0.0.1:1"}})
    core = WorkerCore(worker)
    try:
        assert core.ops.threads == 1  # the profile's kernel threads
    finally:
        core.prefix.close()
        core.experts.close()
        core.container.close()


def test_a_profile_of_another_machine_is_ignored(tmp_path: Path) -> None:
    settings = load_settings(config(tmp_path))
    save_profile(settings, Profile(machine="another CPU; 64 CPUs; 512 GiB", queue_depth=3))
    assert load_profile(settings) is None and apply_profile(settings).storage.queue_depth == 8
    profile_path(settings).write_text("{not json")
    assert load_profile(settings) is None
