"""`moetier doctor`: every check on a good container (text and --json, the exit code following the
failures), and each bad case built on purpose with its message: an int4 MTP head, per-row int4
experts, a missing tokenizer, an expert cache larger than RAM, a mirror on the primary's device,
internal services bound to every interface. The client snippets name the key's variable only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier.cli import main
from moetier.convert.synth import write_container
from moetier.doctor import FAIL, OK, WARN, Check, client_snippets, run_checks
from moetier.settings import Settings, load_settings
from moetier.weights.dense import DenseFileWriter, DenseSpec
from moetier.weights.format import xxh3_file
from moetier.weights.quant import quantize


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Group scales narrower than every row (g16): nothing per-row."""
    return write_container("tiny-qwen3_moe", tmp_path_factory.mktemp("doctor") / "good", 0, group_size=16)


def settings_for(tmp: Path, container: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {"data_dir": str(tmp / "data"), "model": {"path": str(container)}}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v}
    return load_settings(overrides=base, environ={})


def checks(tmp: Path, container: Path, **over: Any) -> dict[str, Check]:
    out = run_checks(settings_for(tmp, container, **over), container, disk=False, kernels=False)
    return {c.name: c for c in out}


def copy(good: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(good, tmp / "m"))


def test_every_check_through_the_command(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\n")
    code = main(["doctor", "--model", str(good), "--config", str(cfg), "--json"])
    out = json.loads(capsys.readouterr().out)
    names = {c["name"] for c in out["checks"]}
    assert {"cpu", "kernels", "free disk", "O_DIRECT", "device", "random reads", "checksums", "layout", "MTP head",
            "expert quantization", "tokenizer", "memory", "mirrors", "bind addresses"} <= names
    assert all(c["status"] in (OK, WARN, FAIL) for c in out["checks"])
    by = {c["name"]: c for c in out["checks"]}
    assert by["kernels"]["data"]["gbps"] > 0 and by["kernels"]["data"]["backend"]
    assert by["random reads"]["data"]["reads"] > 0
    assert by["expert quantization"]["status"] == OK and by["tokenizer"]["status"] == OK
    assert out["failures"] == sum(c["status"] == FAIL for c in out["checks"])
    assert code == (1 if out["failures"] else 0) and out["ok"] == (out["failures"] == 0)
    assert set(out["clients"]) == {"openai", "claude_code", "codex", "curl"}
    code = main(["doctor", "--model", str(good), "--config", str(cfg), "--no-disk", "--no-kernels"])
    text = capsys.readouterr().out
    assert "checks:" in text and "--- Claude Code" in text and "layout: dense/ and experts/" in text


def test_an_int4_mtp_head_fails(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = copy(good, tmp_path)
    (m / "mtp").mkdir()
    t = quantize(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "int4", 64)
    w = DenseFileWriter(m / "mtp" / "head.safetensors", [DenseSpec("mtp.proj", "int4", (64, 64), 64)])
    w.add("mtp.proj", t)
    w.close()
    manifest = json.loads((m / "moetier.json").read_text())
    f = m / "mtp" / "head.safetensors"
    manifest["files"]["mtp/head.safetensors"] = {"size": f.stat().st_size, "xxh3_64": xxh3_file(f)}
    (m / "moetier.json").write_text(json.dumps(manifest))
    c = checks(tmp_path, m)["MTP head"]
    assert c.status == FAIL and "int4" in c.message and "int8" in c.fix
    assert main(["doctor", "--model", str(m), "--no-disk", "--no-kernels", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_per_row_int4_experts_warn_with_the_measured_loss(tmp_path: Path) -> None:
    m = write_container("tiny-qwen3_moe", tmp_path / "per-row", 0, group_size=64)  # hidden 64: one group a row
    c = checks(tmp_path, m)["expert quantization"]
    assert c.status == WARN and "per-row int4" in c.message and "--group-size 64" in c.fix
    assert c.data is not None and c.data["per_row"] > 0


def test_a_missing_tokenizer_fails(good: Path, tmp_path: Path) -> None:
    m = copy(good, tmp_path)
    (m / "tokenizer.json").unlink()
    c = checks(tmp_path, m)["tokenizer"]
    assert c.status == FAIL and "no tokenizer.json" in c.message


def test_an_expert_cache_larger_than_ram_fails(good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetier import doctor

    ram = 64 << 10  # a machine of 64 KiB: the tiny model's experts (~130 KiB) do not fit
    monkeypatch.setattr(doctor, "meminfo", lambda: {"MemTotal": ram, "MemAvailable": ram})
    c = checks(tmp_path, good, model={"expert_cache": "100%"})["memory"]
    assert c.status == FAIL and "more than the machine's RAM" in c.message and "expert_cache" in c.fix
    assert c.data is not None and c.data["expert_cache_bytes"] + c.data["dense_bytes"] > ram
    monkeypatch.undo()
    assert checks(tmp_path, good, model={"expert_cache": "100%"})["memory"].status == OK  # this machine's RAM


def test_a_mirror_on_the_primarys_device_fails(good: Path, tmp_path: Path) -> None:
    mirror = Path(shutil.copytree(good / "experts", tmp_path / "mirror" / "experts"))
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_checks(settings_for(tmp_path, good, storage={"mirrors": [str(mirror.parent), str(empty)]}), good,
                     disk=False, kernels=False)
    mirrors = [c for c in out if c.name == "mirrors"]
    assert [c.status for c in mirrors] == [FAIL, FAIL]
    assert "same device as the primary" in mirrors[0].message and "no expert files" in mirrors[1].message


def test_internal_services_on_every_interface_warn(good: Path, tmp_path: Path) -> None:
    c = checks(tmp_path, good, router={"bind": "0.0.0.0:50051"})["bind addresses"]
    assert c.status == WARN and "router (0.0.0.0:50051)" in c.message
    assert checks(tmp_path, good)["bind addresses"].status == OK


def test_snippets_name_the_key_variable_never_its_value(good: Path, tmp_path: Path) -> None:
    s = client_snippets(settings_for(tmp_path, good, gateway={"api_key": "sk-secret-123", "bind": "127.0.0.1:8123"}),
                        "m")
    joined = "\n".join(s.values())
    assert "sk-secret-123" not in joined and "MOETIER_GATEWAY__API_KEY" in joined
    assert 'base_url="http://127.0.0.1:8123/v1"' in s["openai"] and 'env_key = "MOETIER_GATEWAY__API_KEY"' in s["codex"]
    assert '"ANTHROPIC_BASE_URL": "http://127.0.0.1:8123"' in s["claude_code"]
