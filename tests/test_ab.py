"""`moetier ab` against two gateways (scripted routers): rounds x prompts x endpoints, the
timings and speeds of each answer, the field-by-field diff of JSON answers, keys taken from
the environment variables named, the table and --json outputs, and clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_gateway import MODEL, Served, make_model_dir, reply_script, served

from moetier.cli import main
from moetier.commands.ab import json_diff
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    model = ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("m")))
    with served(model) as a, served(model, api_key="k-b") as b:
        tok = model.tokenizer
        a.fake.script = lambda r: reply_script(tok, '{"disk": "nvme", "gb_s": 7, "tags": ["a"]}')  # type: ignore[assignment,misc]
        b.fake.script = lambda r: reply_script(tok, '{"disk": "sata", "gb_s": 7}')  # type: ignore[assignment,misc]
        yield a, b


def test_ab_json(pair: tuple[Served, Served], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.setenv("B_KEY", "k-b")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    rc = main(["ab", "--a", f"{a.url}/v1", "--a-model", MODEL, "--b", f"{b.url}/v1", "--b-model", MODEL,
               "--b-key-env", "B_KEY", "--b-name", "other", "--prompts", str(prompts), "--rounds", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    runs = out["runs"]
    assert [(r["round"], r["prompt"], r["endpoint"]) for r in runs] == [
        (rnd, p, e) for rnd in (1, 2) for p in (0, 1) for e in ("a", "other")]
    for r in runs:
        assert r["error"] is None and r["tokens"] > 3 and r["chars"] == len(r["text"])
        assert 0 < r["ttft_s"] <= r["total_s"] and r["chars_per_s"] > 0 and r["tokens_per_s"] > 0
    assert len(out["json_diffs"]) == 4
    assert out["json_diffs"][0]["differences"] == [
        {"path": "$.disk", "a": "nvme", "b": "sata", "only": None},
        {"path": "$.tags[0]", "a": "a", "b": None, "only": "a"}]
    assert len(a.fake.requests) == 4 and a.fake.requests[0].sampling.max_tokens == 64  # the default


def test_ab_table_from_yaml(pair: tuple[Served, Served], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.setenv("B_KEY", "k-b")
    cfg = tmp_path / "ab.yaml"
    cfg.write_text(json.dumps({"endpoints": [{"name": "small", "base_url": f"{a.url}/v1", "model": MODEL},
                                             {"name": "big", "base_url": f"{b.url}/v1", "model": MODEL,
                                              "api_key_env": "B_KEY"}],
                               "prompts": ["only one"], "rounds": 1, "max_tokens": 40}))
    assert main(["ab", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["prompt", "round", "endpoint", "TTFT", "s", "total", "s", "chars/s", "tokens/s", "tokens"]
    assert [line.split()[2] for line in out[1:3]] == ["small", "big"]
    assert out[3] == "prompt 1, round 1: JSON differs (small | big):"
    assert a.fake.requests[-1].sampling.max_tokens == 40


def test_ab_errors(pair: tuple[Served, Served], capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.delenv("B_KEY", raising=False)
    base = ["ab", "--a", f"{a.url}/v1", "--a-model", MODEL, "--rounds", "1"]
    assert main([*base, "--b", f"{b.url}/v1", "--b-model", MODEL, "--b-key-env", "B_KEY"]) == 1
    assert "the environment variable B_KEY is not set" in capsys.readouterr().err
    assert main([*base, "--b", f"{b.url}/v1", "--b-model", MODEL]) == 1  # b wants a key
    assert "endpoint b: 401" in capsys.readouterr().err
    assert main(base) == 1
    assert "give exactly two endpoints" in capsys.readouterr().err
    assert main([*base, "--b", "http://127.0.0.1:9/v1", "--b-model", MODEL]) == 1
    assert "endpoint b: cannot reach http://127.0.0.1:9/v1" in capsys.readouterr().err


def test_json_diff() -> None:
    assert json_diff("not json", "{}") is None
    assert json_diff('```json\n{"a": [1, 2]}\n```', '{"a": [1, 3], "b": {}}') == [
        {"path": "$.a[1]", "a": 2, "b": 3, "only": None}, {"path": "$.b", "a": None, "b": {}, "only": "b"}]
    assert json_diff('{"x": 1}', '{"x": 1}') == []
