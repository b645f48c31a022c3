"""The systems under test, each an OpenAI server started as its users start it:

  * `moetier up --config FILE` (the four services; the config gives free loopback ports, a
    fresh data_dir per start, the model and its expert cache);
  * `python -m moetier.bench.peers.engine_server` (--in-process: the in-process engine);
  * llama_cpp.server from the peer venv (through llama_server.py), 2 threads, the weights
    repacked (its default) or left mmapped (--no-repack).

Each starts in its own session with its sandbox set up before exec (a cgroup joined, the CPU
affinity given, SIGTERM when the benchmark dies), and `baseline()` reads the RSS of each of
its processes right after it is ready, before any request.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from moetier.bench.peers.client import wait_ready
from moetier.bench.peers.peer import Peer
from moetier.bench.peers.sandbox import Cgroup, Sandbox, rss_bytes
from moetier.errors import Unavailable
from moetier.launch import free_ports
from moetier.lifeline import die_with_parent

START_TIMEOUT_S = 900.0
READY = re.compile(r"^moetier: (\w+)\s+ready\s+\(pid (\d+),")
UP = re.compile(r"^moetier is up: (http://\S+)/v1\s+\(model '([^']+)'")


def _preexec(cgroup: Cgroup | None, cpus: list[int]) -> Callable[[], None]:
    die = die_with_parent(os.getpid())

    def fn() -> None:
        if die is not None:
            die()
        if cgroup is not None:
            cgroup.join()
        os.sched_setaffinity(0, cpus)

    return fn


@dataclass
class System:
    """One system under test. Subclasses give the command; this runs and stops it."""

    label: str  # the row's name in the tables
    kind: str  # "llama.cpp" | "moetier"
    work: Path  # where its logs and state of this start go
    usage: bool = False  # the server sends stream_options usage
    url: str = ""
    model_name: str = ""
    proc: subprocess.Popen[bytes] | None = None
    sandbox: Sandbox = field(default_factory=Sandbox)
    pids: dict[str, int] = field(default_factory=dict)  # process name -> pid
    _log: IO[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self, cgroup: Cgroup | None, cpus: list[int]) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        log_path = self.work / "server.log"
        self._log = open(log_path, "ab")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=self.work, start_new_session=True, preexec_fn=_preexec(cgroup, cpus))
        self.sandbox = Sandbox(cgroup=cgroup, root_pid=self.proc.pid)
        self.pids = {self.kind: self.proc.pid}
        lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None and self._log is not None
            for raw in self.proc.stdout:
                self._log.write(raw)
                self._log.flush()
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                if self.on_line(line):
                    ready.set()

        threading.Thread(target=pump, name=f"{self.kind}-log", daemon=True).start()
        try:
            self.wait(ready, lines)
        except BaseException:
            self.stop()
            raise
        self.sandbox.start_sampling()

    def on_line(self, line: str) -> bool:
        """A line of the server's output; True once it says it is ready."""
        return False

    def wait(self, ready: threading.Event, lines: list[str]) -> None:
        assert self.proc is not None
        wait_ready(self.url, lambda: self.proc is not None and self.proc.poll() is None, START_TIMEOUT_S,
                   f"{self.label} (log {self.work / 'server.log'}):\n" + "\n".join(lines[-15:]))

    def processes(self) -> dict[str, int]:
        """Its processes by the name the tables give them -> pid."""
        return dict(self.pids)

    def baseline(self) -> dict[str, int]:
        """RSS of each of its processes now (call right after start: before any request)."""
        return {name: rss_bytes(pid) for name, pid in self.processes().items()}

    def peaks(self) -> dict[str, int]:
        """Peak RSS of each of its processes since it started (VmHWM; call before stop)."""
        return {name: rss_bytes(pid, field="VmHWM") for name, pid in self.processes().items()}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 60.0) -> None:
        self.sandbox.stop_sampling()
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT if self.kind == "moetier" else signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.sandbox.cgroup is not None:  # anything of its tree still alive (a child that outlived it);
            for pid in self.sandbox.pids():  # without a cgroup its children die with it (PR_SET_PDEATHSIG)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class LlamaCpp(System):
    peer: Peer | None = None
    gguf: Path = Path()
    threads: int = 2
    n_ctx: int = 2048
    repack: bool = True

    def argv(self) -> list[str]:
        assert self.peer is not None
        port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{port}"
        self.model_name = self.gguf.stem
        flags = [] if self.repack else ["--no-repack"]
        return self.peer.script("llama_server.py", *flags, "--model", str(self.gguf), "--model_alias",
                                self.model_name, "--host", "127.0.0.1", "--port", str(port),
                                "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                                "--n_ctx", str(self.n_ctx), "--use_mmap", "true", "--logits_all", "false",
                                # the server locks the model in RAM by default (use_mlock), which a
                                # memory cap smaller than the model turns into an OOM kill at load
                                "--use_mlock", "false", "--verbose", "false")


@dataclass
class MoetierUp(System):
    model: Path = Path()
    expert_cache: str = "100%"
    activations: str = "exact"  # kernels.activations (int8: lossy)
    usage: bool = True

    def argv(self) -> list[str]:
        names = ["router", "dense_worker", "expert_store"]
        ports = free_ports(2 * len(names) + 1)
        cfg: dict[str, object] = {
            "data_dir": str(self.work / "data"),
            "model": {"path": str(self.model), "expert_cache": self.expert_cache},
            "gateway": {"bind": f"127.0.0.1:{ports[-1]}"},
            "kernels": {"activations": self.activations},
        }
        for i, name in enumerate(names):
            cfg[name] = {"bind": f"127.0.0.1:{ports[2 * i]}", "address": f"127.0.0.1:{ports[2 * i]}",
                         "metrics_port": ports[2 * i + 1]}
        path = self.work / "moetier.yml"
        path.write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{ports[-1]}"
        return [sys.executable, "-m", "moetier.cli", "up", "--config", str(path), "--start-timeout",
                str(int(START_TIMEOUT_S))]

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}  # the config decides

    def on_line(self, line: str) -> bool:
        if m := READY.match(line):
            self.pids[m.group(1)] = int(m.group(2))
        if m := UP.match(line):
            self.url, self.model_name = m.group(1), m.group(2)
            return True
        return False

    def wait(self, ready: threading.Event, lines: list[str]) -> None:
        deadline = time.monotonic() + 4 * START_TIMEOUT_S  # `moetier up` times each service out itself
        while not ready.wait(0.2):
            if not self.alive() or time.monotonic() > deadline:
                raise Unavailable(f"{self.label} did not come up (log {self.work / 'server.log'}):\n"
                                  + "\n".join(lines[-25:]))

    def processes(self) -> dict[str, int]:
        """Each service, and `moetier up` (the supervisor) as "up"."""
        return {("up" if name == self.kind else name): pid for name, pid in self.pids.items()}


@dataclass
class MoetierInProcess(System):
    model: Path = Path()
    expert_cache: str = "100%"
    activations: str = "exact"  # the engine's kernels (int8: lossy)
    usage: bool = True

    def argv(self) -> list[str]:
        port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{port}"
        self.model_name = self.model.name
        return [sys.executable, "-m", "moetier.bench.peers.engine_server", "--model", str(self.model),
                "--expert-cache", self.expert_cache, "--port", str(port), "--activations", self.activations]

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}

    def processes(self) -> dict[str, int]:
        assert self.proc is not None
        return {"engine": self.proc.pid}
