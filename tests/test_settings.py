"""Settings: precedence flags > env > file > defaults; clear errors; the reference doc is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.commands.config import reference_markdown
from moetier.errors import InvalidArgument
from moetier.settings import load_settings, merge_flags, parse_bytes, resolve_budget

ROOT = Path(__file__).resolve().parent.parent


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cache:\n  policy: lru\n  pin_fraction: 0.25\ninference:\n  max_batch_size: 3\n")
    s = load_settings(cfg, environ={})
    assert (s.cache.policy, s.cache.pin_fraction, s.inference.max_batch_size) == ("lru", 0.25, 3)
    s = load_settings(cfg, environ={"MOETIER_CACHE__POLICY": "lfu"})
    assert (s.cache.policy, s.cache.pin_fraction) == ("lfu", 0.25)
    s = load_settings(cfg, merge_flags(cache__policy="learned", inference__max_batch_size=None),
                      environ={"MOETIER_CACHE__POLICY": "lfu"})
    assert (s.cache.policy, s.inference.max_batch_size) == ("learned", 3)
    assert load_settings(environ={}).cache.policy == "learned"


@pytest.mark.parametrize("text,match", [
    ("cache:\n  polcy: lru\n", "cache.polcy"),
    ("cache:\n  policy: fifo\n", "cache.policy"),
    ("model:\n  expert_cache: lots\n", "not a byte size"),
    ("inference:\n  max_batch_size: 0\n", "inference.max_batch_size"),
    ("kernels:\n  idle_spin_us: -5\n", "kernels.idle_spin_us"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("cache: [\n", "not valid YAML"),
])
def test_bad_config_names_the_problem(tmp_path: Path, text: str, match: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(InvalidArgument, match=match):
        load_settings(cfg, environ={})


@pytest.mark.parametrize("env,match", [
    ({"MOETIER_MODEL": "demo"}, r"environment variable MOETIER_MODEL is not valid JSON .*`model` is a settings "
                                r"section: set its fields as MOETIER_MODEL__<FIELD>"),
    ({"MOETIER_STORAGE__MIRRORS": "[/mnt/a", "MOETIER_STORAGE__IO_ENGINE": "threads"},
     r"environment variable MOETIER_STORAGE__MIRRORS is not valid JSON .*a list is given as JSON"),
    ({"MOETIER_STORAGE__MIRROR_WEIGHTS": "1,2"}, "environment variable MOETIER_STORAGE__MIRROR_WEIGHTS"),
    ({"MOETIER_CACHE": '{"policy": "lru"'}, "environment variable MOETIER_CACHE is not valid JSON"),
])
def test_unparsable_environment_names_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        load_settings(environ=env)


def test_unparsable_environment_is_one_line_from_the_command(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from moetier.cli import main

    monkeypatch.setenv("MOETIER_MODEL", "demo")
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetier config: error: invalid settings: environment "
                                                   "variable MOETIER_MODEL "), err


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_settings(tmp_path / "nope.yaml", environ={})


def test_sizes() -> None:
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512 MB") == 512_000_000 and parse_bytes(7) == 7
    assert resolve_budget("25%", 1000) == 250 and resolve_budget("1KiB", 5) == 1024
    with pytest.raises(InvalidArgument):
        resolve_budget("120%", 10)


def test_reference_doc_is_current() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc.strip() == reference_markdown().strip(), "run: moetier config --reference > docs/config.md"
