"""ruff and mypy are part of the suite: the code base stays clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "tool,args",
    [
        ("ruff", ["check", "moetier", "services", "tests", "scripts"]),
        ("mypy", ["moetier", "services"]),
    ],
)
def test_clean(tool: str, args: list[str]) -> None:
    exe = shutil.which(tool, path=str(Path(sys.executable).parent)) or shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed (it comes with the [test] extra)")
    r = subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{tool} found problems:\n{r.stdout}\n{r.stderr}"
