"""Test support for `moetier up` as a user runs it: the real command in a subprocess of its own
session, its own data_dir and a YAML --config with free loopback ports (so tests never collide
with each other or with a cluster someone runs on :8000), its output read line by line, its
children found by the pids it prints and checked in /proc, and everything killed in `finally`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from helpers_observability import eventually, free_ports
from prometheus_client.parser import text_string_to_metric_families

SERVICES = ("router", "expert_store", "dense_worker", "gateway")
READY = re.compile(r"^moetier: (\w+)\s+ready\s+\(pid (\d+), log: (.+)\)$")
UP = re.compile(r"^moetier is up: (http://\S+)/v1\s")


def moetier_argv() -> list[str]:
    """The `moetier` console script of this interpreter's environment (what a user runs), else
    `python -m moetier.cli`."""
    script = Path(sys.executable).with_name("moetier")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "moetier.cli"]


def write_config(root: Path, extra: dict[str, Any] | None = None) -> tuple[Path, dict[str, int]]:
    """A config file giving every listen address a free loopback port and the data_dir root/data."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["router", "router_metrics", "dense_worker", "dense_worker_metrics", "expert_store",
             "expert_store_metrics", "gateway"]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    cfg: dict[str, Any] = {"data_dir": str(root / "data"), "gateway": {"bind": f"127.0.0.1:{ports['gateway']}"}}
    for name in ("router", "dense_worker", "expert_store"):
        cfg[name] = {"bind": f"127.0.0.1:{ports[name]}", "address": f"127.0.0.1:{ports[name]}",
                     "metrics_port": ports[f"{name}_metrics"]}
    for key, value in (extra or {}).items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path = root / "moetier.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ports


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is `pid`."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(d.name))
    return out


def service_children(pid: int) -> set[int]:
    """children_of(pid) less multiprocessing's resource tracker (left by the demo model's
    parallel build; it exits with its parent)."""
    return {c for c in children_of(pid) if "multiprocessing.resource_tracker" not in _cmdline(c)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Up:
    """A running `moetier up`."""

    proc: subprocess.Popen[str]
    config: Path
    ports: dict[str, int]
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def data_dir(self) -> Path:
        return self.config.parent / "data"

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str | re.Pattern[str], within_s: float) -> re.Match[str]:
        """The first output line matching `pattern`; fails (with the output) if `moetier up`
        exits or `within_s` passes first."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + within_s
        while True:
            for line in list(self.lines):
                if m := rx.search(line):
                    return m
            if self.proc.poll() is not None and (self._reader is None or not self._reader.is_alive()):
                raise AssertionError(f"moetier up exited ({self.proc.returncode}) before {rx.pattern!r}:\n"
                                     + self.output())
            if time.monotonic() > deadline:
                raise AssertionError(f"no {rx.pattern!r} within {within_s:.0f} s:\n" + self.output())
            time.sleep(0.1)

    def wait_up(self, within_s: float = 120) -> str:
        return self.wait_for(UP, within_s).group(1)

    def pids(self) -> dict[str, int]:
        """Service -> pid, from the `ready` lines `moetier up` printed."""
        return {m.group(1): int(m.group(2)) for line in list(self.lines) if (m := READY.match(line))}

    def stop(self, sig: signal.Signals = signal.SIGTERM, within_s: float = 60) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(within_s)
        if self._reader is not None:
            self._reader.join(10)
        return code

    def wait_exit(self, within_s: float) -> int:
        code = self.proc.wait(within_s)
        if self._reader is not None:
            self._reader.join(10)
        return code

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def kill_all(self) -> None:
        """Last resort in `finally`: the children (each in a session of its own) and `moetier up`."""
        for pid in [*self.pids().values(), *children_of(self.proc.pid)]:
            if alive(pid) and "moetier" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def moetier_up(config: Path, ports: dict[str, int], *args: str, env: dict[str, str] | None = None) -> Iterator[Up]:
    """`moetier up --config CONFIG ARGS...` in a session of its own; killed (with its children)
    on the way out whatever happened."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    base.pop("PYTHONUNBUFFERED", None)  # moetier up must flush its own lines, whatever the environment
    proc = subprocess.Popen([*moetier_argv(), "up", "--config", str(config), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**base, **(env or {})},
                            start_new_session=True)
    up = Up(proc, config, ports)
    up._reader = threading.Thread(target=up._read, daemon=True, name="moetier-up-output")
    up._reader.start()
    try:
        yield up
    finally:
        up.kill_all()


def metrics(url: str) -> dict[str, float]:
    """A /metrics page as {'name{label="v",...}': value}; labels sorted."""
    text = httpx.get(url, timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


__all__ = [
    "SERVICES",
    "Up",
    "alive",
    "children_of",
    "eventually",
    "metrics",
    "moetier_argv",
    "moetier_up",
    "service_children",
    "write_config",
]
