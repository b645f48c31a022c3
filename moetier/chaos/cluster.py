"""The cluster the chaos harness breaks: the four services `moetier up` runs, started with the
same commands and settings (moetier.launch.service_specs), but supervised here, so one service
can be killed and restarted while the others keep running (`moetier up` stops them all when one
exits, see moetier/launch.py).

Layout of a run directory:
    moetier.yml        the config: free loopback ports, small queues, the mirror, the test hooks
    data/              data_dir: the demo model (data/models/demo), logs
    mirror/            a full copy of the container's experts/ (storage.mirrors)
    volatile/          prefix cache and usage history; a small tmpfs when this process may mount
                       one (the disk-full faults need it), else a plain directory
    hooks/             the test-only fault hooks' files (read delay, clock offset)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from moetier.errors import Unavailable
from moetier.launch import (
    SERVICES,
    ServiceSpec,
    ensure_model,
    free_ports,
    gateway_url,
    parent_env,
    service_specs,
)
from moetier.settings import Settings, load_settings

log = logging.getLogger(__name__)

VOLATILE_BYTES = 16 << 20  # the tmpfs of the prefix cache and usage history


def proc_stats(pid: int) -> dict[str, int] | None:
    """RSS bytes, open fds and threads of a live process (None when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    values = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_bytes": int(values["VmRSS"].split()[0]) * 1024 if "VmRSS" in values else 0,
            "fds": fds, "threads": int(values.get("Threads", "0"))}


def _can_mount() -> bool:
    return sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("mount") is not None


@dataclass
class ChaosCluster:
    root: Path
    settings: Settings = field(init=False)
    config: Path = field(init=False)
    model_dir: Path = field(init=False)
    specs: dict[str, ServiceSpec] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    tmpfs: bool = False
    _logs: list[IO[bytes]] = field(default_factory=list)

    # ---- layout -----------------------------------------------------------------------
    @property
    def mirror(self) -> Path:
        return self.root / "mirror"

    @property
    def volatile(self) -> Path:
        return self.root / "volatile"

    @property
    def prefix_dir(self) -> Path:
        return self.volatile / "prefix-cache"

    @property
    def history_path(self) -> Path:
        return self.volatile / "history" / "store-0.hist"

    @property
    def read_delay_file(self) -> Path:
        return self.root / "hooks" / "read_delay_s"

    @property
    def clock_offset_file(self) -> Path:
        return self.root / "hooks" / "clock_offset_s"

    @property
    def url(self) -> str:
        return gateway_url(self.settings)

    def metrics_url(self, service: str) -> str:
        if service == "gateway":
            return self.url + "/metrics"
        return f"http://127.0.0.1:{getattr(self.settings, service).metrics_port}/metrics"

    def address(self, service: str) -> str:
        return str(getattr(self.settings, service).address)

    def prepare(self, max_seq_len: int = 1024) -> None:
        """Write the config, build the demo model, copy the mirror, mount the volatile tmpfs."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "hooks").mkdir(exist_ok=True)
        self.read_delay_file.write_text("0\n")
        self.clock_offset_file.write_text("0\n")
        self.volatile.mkdir(exist_ok=True)
        if _can_mount() and not os.path.ismount(self.volatile):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLATILE_BYTES},mode=0755", "tmpfs",
                                str(self.volatile)], capture_output=True, text=True)
            if r.returncode != 0:
                log.info("no tmpfs for the volatile directory (%s): the disk-full faults are skipped",
                         r.stderr.strip())
        self.tmpfs = os.path.ismount(self.volatile)
        self.prefix_dir.mkdir(parents=True, exist_ok=True)
        self.history_path.parent.mkdir(parents=True, exist_ok=True)
        names = ["router", "router_metrics", "dense_worker", "dense_worker_metrics", "expert_store",
                 "expert_store_metrics", "gateway"]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        cfg: dict[str, Any] = {
            "data_dir": str(self.root / "data"),
            "gateway": {"bind": f"127.0.0.1:{ports['gateway']}"},
            # small queues, so that a flood meets them: 429 past the router's 32
            "queue_capacity": 32,
            "heartbeat_interval_s": 0.5,
            "member_expiry_s": 3.0,
            "test_clock_offset_file": str(self.clock_offset_file),
            "inference": {"max_seq_len": max_seq_len, "max_waiting": 16,
                          "prefix_cache_dir": str(self.prefix_dir)},
            "cache": {"history_path": str(self.history_path)},
            "storage": {"mirrors": [str(self.mirror)], "mirror_weights": [1.0, 1.0],
                        "test_read_delay_file": str(self.read_delay_file)},
        }
        for name in ("router", "dense_worker", "expert_store"):
            cfg[name] = {"bind": f"127.0.0.1:{ports[name]}", "address": f"127.0.0.1:{ports[name]}",
                         "metrics_port": ports[f"{name}_metrics"]}
        self.config = self.root / "moetier.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.settings = load_settings(self.config, environ={})
        self.model_dir = ensure_model(self.settings, echo=log.info)
        if not self.mirror.exists():
            shutil.copytree(self.model_dir / "experts", self.mirror)
        self.specs = {s.name: s for s in service_specs(self.settings, self.model_dir, self.config)}

    # ---- processes --------------------------------------------------------------------
    def start(self, name: str, timeout_s: float = 180.0) -> None:
        spec = self.specs[name]
        log_dir = self.settings.data_path / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        f = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 -- closed in close()
        self._logs.append(f)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
        env.update(spec.env)
        env.update(parent_env(os.getpid()))
        argv = [sys.executable, "-m", "moetier.cli", *spec.argv]
        if name == "expert_store" and os.geteuid() == 0 and shutil.which("setpriv"):
            # root reads any file whatever its mode: without these capabilities the store obeys
            # permissions, so a mirror made unreadable (chmod 000) is unreadable to it
            argv = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", *argv]
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = p
        deadline = time.monotonic() + timeout_s
        while not spec.health():
            if p.poll() is not None:
                raise Unavailable(f"{name} exited with code {p.returncode} during start-up (log: "
                                  f"{log_dir / (name + '.log')})")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not healthy after {timeout_s:.0f} s")
            time.sleep(0.1)

    def start_all(self) -> None:
        for name in SERVICES:
            if not self.alive(name):
                self.start(name)

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def signal(self, name: str, sig: signal.Signals) -> None:
        p = self.procs[name]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def wait_exit(self, name: str, timeout_s: float = 30.0) -> int:
        p = self.procs[name]
        try:
            return p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0f s of its signal; killing it", name, timeout_s)
            p.kill()
            return p.wait()

    def stats(self) -> dict[str, dict[str, int] | None]:
        return {name: proc_stats(p.pid) if p.poll() is None else None for name, p in self.procs.items()}

    def close(self) -> None:
        for name in reversed(SERVICES):
            if self.alive(name):
                self.signal(name, signal.SIGTERM)
                self.wait_exit(name, 20)
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.volatile)], capture_output=True)
            self.tmpfs = False
