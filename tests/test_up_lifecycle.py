"""`moetier up` as a process supervisor: the first start builds the demo model and the second
reuses it; SIGINT and SIGTERM stop all four children (their pids, as printed and as /proc
knows them, are gone afterwards); a child that dies takes the others down and `moetier up`
exits non-zero with its log tail; a signal during start-up stops what was started; a SIGKILL
of `moetier up` itself takes its children with it; busy ports are refused before anything
starts. The tests share one data_dir and run in file order."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
import pytest
from helpers_up import (
    SERVICES,
    Up,
    alive,
    children_of,
    eventually,
    moetier_argv,
    moetier_up,
    service_children,
    write_config,
)

from moetier.engine import trained_demo_source

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lifecycle")


def demo_manifest(root: Path) -> Path:
    return root / "data" / "models" / "demo" / "moetier.json"


def started(up: Up) -> dict[str, int]:
    """Wait for the cluster. Every child of `moetier up` by pid (as /proc knows them): the four
    services, whose pids must be the ones it printed, and any helper of its own."""
    up.wait_up(180)
    pids = up.pids()
    assert sorted(pids) == sorted(SERVICES), up.output()
    assert set(pids.values()) == service_children(up.proc.pid), "moetier up's children are not the ones it printed"
    assert all(alive(p) for p in pids.values())
    return {**{str(p): p for p in children_of(up.proc.pid)}, **pids}


def assert_all_gone(pids: dict[str, int]) -> None:
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    assert not left, f"processes left running: {left}"


def chat(up: Up) -> None:
    r = httpx.post(f"{up.url}/v1/chat/completions", timeout=60,
                   json={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text


def test_first_start_builds_the_demo_model_and_sigint_stops_every_child(root: Path) -> None:
    config, ports = write_config(root)
    with moetier_up(config, ports) as up:
        pids = started(up)
        assert "moetier: building the demo model in" in up.output()
        source = json.loads(demo_manifest(root).read_text())["source"]  # the trained demo, else the synth preset
        assert (source["kind"], source.get("preset", "demo")) == ("hf" if trained_demo_source() else "synth", "demo")
        curl = up.wait_for(r"^\s+(curl .*)$", 0).group(1)
        assert "Authorization" not in curl  # no key set
        if shutil.which("curl"):
            r = subprocess.run(["bash", "-c", curl + " --silent --show-error --max-time 60"], capture_output=True,
                               text=True, timeout=90)
            assert r.returncode == 0 and json.loads(r.stdout)["object"] == "chat.completion", r.stdout + r.stderr
        else:
            chat(up)
        assert up.stop(signal.SIGINT) == 0, up.output()
        assert_all_gone(pids)
        assert up.output().splitlines()[-1] == "moetier: stopped"


def test_second_start_reuses_the_demo_model_and_sigterm_stops_every_child(root: Path) -> None:
    manifest = demo_manifest(root)
    if not manifest.exists():
        pytest.skip("runs after test_first_start_builds_the_demo_model_and_sigint_stops_every_child")
    before = manifest.stat().st_mtime_ns
    config, ports = write_config(root)
    with moetier_up(config, ports) as up:
        pids = started(up)
        assert "building the demo model" not in up.output()
        chat(up)
        assert up.stop(signal.SIGTERM) == 0, up.output()
        assert_all_gone(pids)
    assert manifest.stat().st_mtime_ns == before


def test_a_child_that_dies_stops_the_others_and_fails_with_its_log(root: Path) -> None:
    config, ports = write_config(root)
    with moetier_up(config, ports) as up:
        pids = started(up)
        os.kill(pids["dense_worker"], signal.SIGKILL)
        assert up.wait_exit(60) == 1, up.output()
        out = up.output()
        assert f"moetier: dense_worker exited with code {-signal.SIGKILL}; stopping the others" in out
        assert f"--- last lines of {up.data_dir / 'logs' / 'dense_worker.log'} ---" in out
        assert "dense worker serving on" in out  # the tail itself
        assert_all_gone(pids)


def test_a_signal_during_start_up_stops_what_was_started(root: Path) -> None:
    config, ports = write_config(root)
    with moetier_up(config, ports) as up:
        up.wait_for(r"^moetier: router\s+ready", 120)
        children = children_of(up.proc.pid)  # the router, and the expert store starting
        assert children
        up.proc.send_signal(signal.SIGINT)
        assert up.wait_exit(60) == 0, up.output()
        assert "moetier is up" not in up.output()
        assert_all_gone({str(pid): pid for pid in children})


def test_a_sigkill_of_moetier_up_takes_every_child_with_it(root: Path) -> None:
    config, ports = write_config(root)
    with moetier_up(config, ports) as up:
        pids = started(up)
        up.proc.kill()  # no handler runs: the children must learn of it from the kernel
        up.proc.wait(10)
        t0 = time.monotonic()

        def left() -> dict[str, int]:
            return {name: pid for name, pid in pids.items() if alive(pid)}

        try:
            eventually(lambda: not left(), 15, "every child of the killed moetier up gone")
        except AssertionError:
            pytest.fail(f"still running 15 s after moetier up was SIGKILLed: {left()}")
        print(f"\nchildren gone {time.monotonic() - t0:.1f} s after moetier up was killed")


SLEEPER = """
import os, subprocess, sys, time
from moetier.lifeline import die_with_parent
child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent(int(sys.argv[1]) or os.getpid()))
print(child.pid, flush=True)
print(child.wait(), flush=True)
"""


def check_child_dies_with_parent(script: str, started: Callable[[IO[str]], None] = lambda out: None) -> None:
    """`script` (argv[1] "0": its own pid is the parent to die with) starts a child, prints its pid,
    then what `started` reads, then the child's exit code. The child must go when the script is
    SIGKILLed; and started with a pid that is not its parent (one that died between fork and the
    binding would never send the signal) it must exit at once with 1."""
    parent = subprocess.Popen([sys.executable, "-c", script, "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        started(parent.stdout)
        assert alive(child)
        parent.kill()
        parent.wait(10)
        eventually(lambda: not alive(child), 5, "the child of a SIGKILLed parent gone")
    finally:
        if parent.poll() is None:
            parent.kill()
    r = subprocess.run([sys.executable, "-c", script, "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.split()[-1] == "1", r.stdout + r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_supervised_child_dies_with_its_parent_even_one_already_gone() -> None:
    check_child_dies_with_parent(SLEEPER)


def test_busy_ports_are_refused_before_anything_starts(tmp_path: Path) -> None:
    config, ports = write_config(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports["gateway"]))
        holder.listen()
        r = subprocess.run([*moetier_argv(), "up", "--config", str(config)], capture_output=True, text=True,
                           timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")})
    assert r.returncode == 1
    assert f"gateway 127.0.0.1:{ports['gateway']}" in r.stderr and "ports in use" in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()  # no model built, no child started


def test_a_directory_that_is_not_a_container_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    config, _ = write_config(tmp_path / "c")
    r = subprocess.run([*moetier_argv(), "up", "--config", str(config), "--model", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")})
    assert r.returncode == 1 and "moetier convert SRC OUT" in r.stderr, r.stderr


LAUNCHER = """
import os, subprocess, sys
from moetier.lifeline import parent_env
code = "import os, time; from moetier.lifeline import die_with_launcher, PARENT_ENV; die_with_launcher(); " \\
       "print(PARENT_ENV in os.environ, flush=True); time.sleep(60)"
pid = int(sys.argv[1]) or os.getpid()
child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **parent_env(pid)}, stdout=subprocess.PIPE,
                         text=True)
print(child.pid, flush=True)
print(child.stdout.readline().strip() if not int(sys.argv[1]) else "", flush=True)
print(child.wait(), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_moetier_child_started_without_preexec_dies_with_its_launcher_even_one_already_gone() -> None:
    """The services of `moetier up` and `moetier chaos` are started with parent_env, not a
    preexec_fn: the child sets PR_SET_PDEATHSIG itself (die_with_launcher) and drops the entry."""

    def entry_dropped(out: IO[str]) -> None:
        assert out.readline().strip() == "False"  # the entry is not passed on

    check_child_dies_with_parent(LAUNCHER, entry_dropped)
