"""README.md is the newcomer's path: its first two commands are the run and test commands
(.ci/run runs the second verbatim), every `moetier <subcommand>` it mentions exists, and
every file it links to is in the repository."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from moetier.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/moetier up"
TEST = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest"


def code(text: str, langs: tuple[str, ...] | None = None) -> list[str]:
    """Fenced blocks (those in `langs` only, when given), then inline code spans."""
    fenced = [body for lang, body in re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)
              if langs is None or lang.strip() in langs]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return fenced + re.findall(r"`([^`\n]+)`", prose)


def test_the_first_two_commands_run_moetier_and_its_tests() -> None:
    text = README.read_text()
    first = code(text)[0].splitlines()
    commands = [line for line in first if line.strip() and not line.startswith("#")]
    assert commands[:2] == [RUN, TEST]
    assert first[:4] == ["# run moetier (first start builds the demo model)", RUN, "# run the tests", TEST]


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run's own extraction (its `cmd=$(...)` line, run by bash) yields the test command."""
    script = (ROOT / ".ci" / "run").read_text()
    (line,) = [x for x in script.splitlines() if x.startswith("cmd=$(")]
    r = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$cmd"'], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == TEST


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def mentioned_commands() -> list[tuple[str, ...]]:
    """Every `moetier <sub>` (and `moetier bench <name>`) in the README's shell blocks and
    inline code (not in sample output or Python)."""
    subs = _subparsers(build_parser())
    found: list[tuple[str, ...]] = []
    for snippet in code(README.read_text(), langs=("sh", "bash", "shell")):
        for m in re.finditer(r"(?:^|[\s/`(])moetier ([a-z][\w-]*)(?: ([a-z][\w-]*))?", snippet, flags=re.M):
            cmd = (m.group(1),)
            if m.group(2) and cmd[0] in subs and _subparsers(subs[cmd[0]]):
                cmd = (cmd[0], m.group(2))
            if cmd not in found:
                found.append(cmd)
    return found


def test_the_readme_mentions_the_commands_a_newcomer_needs() -> None:
    assert {("up",), ("chat",), ("convert",), ("inspect",), ("config",), ("bench", "io"), ("bench", "cache"),
            ("bench", "compute"), ("bench", "e2e")} <= set(mentioned_commands())


@pytest.mark.parametrize("command", mentioned_commands(), ids=" ".join)
def test_every_moetier_subcommand_in_the_readme_exists(command: tuple[str, ...],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--help"])
    assert e.value.code == 0, f"moetier {' '.join(command)} --help"
    assert "usage: moetier " + " ".join(command) in capsys.readouterr().out


def test_the_moetier_command_itself_answers() -> None:
    """The installed entry point (not only the parser) runs: `python -m moetier.cli up --help`."""
    import sys

    r = subprocess.run([sys.executable, "-m", "moetier.cli", "up", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "usage: moetier up" in r.stdout, r.stderr


def test_every_linked_file_exists() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [x for x in links if not re.match(r"\w+://", x)]
    assert local, "no links found"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, missing
    for path in re.findall(r"`((?:deploy|docs|moetier|services|proto|tests)/[\w./-]*)`", text):
        if "{" not in path:
            assert (ROOT / path).exists(), path
