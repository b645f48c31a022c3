"""One command line: every command that concerns a model takes --model DIR and --config the same
way (`moetier config --model DIR` included), and each command's --help ends with the environment
variables of the settings it reads, every one of them documented in docs/config.md."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from moetier.cli import build_parser, main
from moetier.convert.synth import write_container

DOCS = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
MODEL_COMMANDS = ("config", "inspect", "doctor", "plan", "simulate", "generate", "logits", "up", "gateway",
                  "dense-worker", "expert-store")


def parsers() -> dict[str, argparse.ArgumentParser]:
    out = {}

    def walk(sub: argparse._SubParsersAction, prefix: str) -> None:  # type: ignore[type-arg]
        for name, p in sub.choices.items():
            out[prefix + name] = p
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    walk(a, prefix + name + " ")

    for a in build_parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            walk(a, "")
    return out


def options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def test_model_commands_take_model_and_config() -> None:
    ps = parsers()
    for name in MODEL_COMMANDS:
        assert {"--model", "--config"} <= options(ps[name]), name


def test_help_lists_the_settings_environment_variables() -> None:
    with_config = {n: p for n, p in parsers().items() if "--config" in options(p)}
    assert len(with_config) >= len(MODEL_COMMANDS)
    for name, p in with_config.items():
        text = p.format_help()
        names = [w.strip(",.") for w in text.split() if w.startswith("MOETIER_")]
        assert names, f"`moetier {name} --help` names no environment variable"
        for var in names:
            assert f"`{var}`" in DOCS, f"{var} (moetier {name} --help) is not in docs/config.md"
    assert "MOETIER_INFERENCE__PREFIX_CACHE_BYTES" in parsers()["dense-worker"].format_help()
    assert "MOETIER_GATEWAY__API_KEY" not in parsers()["expert-store"].format_help()


def test_config_and_inspect_take_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = write_container("tiny-olmoe", tmp_path / "m", 0)
    assert main(["config", "--model", str(m)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["path"] == str(m)
    assert main(["inspect", "--model", str(m)]) == 0
    by_flag = capsys.readouterr().out
    assert main(["inspect", str(m)]) == 0
    assert capsys.readouterr().out == by_flag and "olmoe" in by_flag
    assert main(["inspect", str(m), "--model", str(tmp_path / "other")]) == 1
    assert "two containers given" in capsys.readouterr().err
