"""Test support for the live observability tests: the four services as `moetier up` starts
them (moetier.launch's Supervisor and service_specs, one YAML config, free loopback ports,
a data_dir of the test's own), chat traffic through the gateway from background threads,
and a real Prometheus on a copy of deploy/prometheus/prometheus.local.yml whose targets
point at those ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from moetier.convert.synth import write_container
from moetier.launch import Supervisor, free_ports, gateway_url, service_specs
from moetier.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.local.yml"
SERVICES = ("router", "expert_store", "dense_worker", "gateway")


def eventually(check: Callable[[], Any], within_s: float, what: str, every_s: float = 0.25) -> Any:
    """Poll until check() returns something truthy; its last value, or AssertionError naming `what`."""
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {within_s:.0f} s (last: {value!r})")
        time.sleep(every_s)


def build_model(root: Path, preset: str) -> Path:
    out = root / preset
    if not (out / "moetier.json").exists():
        write_container(preset, out, 0, "int4", "int8", progress=False)
    return out


@dataclass
class Cluster:
    settings: Settings
    config: Path
    model_dir: Path
    url: str  # the gateway, http://127.0.0.1:PORT
    supervisor: Supervisor
    model_name: str

    def metrics_ports(self) -> dict[str, int]:
        """Where each service serves /metrics (job name -> port)."""
        s = self.settings
        return {"gateway": int(s.gateway.bind.rsplit(":", 1)[1]), "router": s.router.metrics_port,
                "dense_worker": s.dense_worker.metrics_port, "expert_store": s.expert_store.metrics_port}

    def logs(self) -> str:
        return "\n".join(self.supervisor.tail(name, 30) for name in SERVICES)


@contextlib.contextmanager
def local_cluster(root: Path, model_dir: Path, *, expert_cache: str = "25%", mirror: bool = False,
                  start_timeout_s: float = 60.0, extra: dict[str, Any] | None = None) -> Iterator[Cluster]:
    """The four services started the way `moetier up` starts them, stopped in reverse order."""
    root.mkdir(parents=True, exist_ok=True)
    ports = free_ports(7)
    storage: dict[str, Any] = {}
    if mirror:
        shutil.copytree(model_dir / "experts", root / "mirror", dirs_exist_ok=True)
        # Fixed weights: no bandwidth probe at start-up; reads spread over both copies.
        storage = {"mirrors": [str(root / "mirror")], "mirror_weights": [1.0, 1.0]}
    cfg: dict[str, Any] = {
        "data_dir": str(root / "data"),
        "model": {"path": str(model_dir), "expert_cache": expert_cache},
        "storage": storage,
        "router": {"bind": f"127.0.0.1:{ports[0]}", "address": f"127.0.0.1:{ports[0]}", "metrics_port": ports[1]},
        "dense_worker": {"bind": f"127.0.0.1:{ports[2]}", "address": f"127.0.0.1:{ports[2]}",
                         "metrics_port": ports[3]},
        "expert_store": {"bind": f"127.0.0.1:{ports[4]}", "address": f"127.0.0.1:{ports[4]}",
                         "metrics_port": ports[5]},
        "gateway": {"bind": f"127.0.0.1:{ports[6]}"},
        "heartbeat_interval_s": 0.5,
    }
    for section, values in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    config = root / "moetier.yml"
    config.write_text(yaml.safe_dump(cfg))
    settings = load_settings(config, environ={})
    sup = Supervisor(settings.data_path / "logs", echo=lambda _: None)
    try:
        for spec in service_specs(settings, model_dir, config):
            proc = sup.start(spec)
            sup.wait_healthy(spec, proc, start_timeout_s)
        yield Cluster(settings, config, model_dir, gateway_url(settings), sup, model_dir.name)
    finally:
        sup.stop_all(grace_s=10)


@dataclass
class Traffic:
    """Chat completions from `threads` background threads until stopped."""

    url: str
    model: str
    threads: int = 2
    max_tokens: int = 12
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Traffic:
        for i in range(self.threads):
            t = threading.Thread(target=self._run, args=(i,), daemon=True, name=f"traffic-{i}")
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(30)

    def _run(self, worker: int) -> None:
        topics = ["disks", "caches", "experts", "routers", "gardens", "rivers", "numbers", "music"]
        n = 0
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                topic = topics[(worker * 3 + n) % len(topics)]
                body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.8,
                        "messages": [{"role": "user", "content": f"Tell me about {topic}, part {n}."}]}
                if n % 2 == 0:  # seeded; the others unseeded, which speculative decoding drafts for
                    body["seed"] = n
                n += 1
                try:
                    r = client.post("/v1/chat/completions", json=body)
                    with self._lock:
                        if r.status_code == 200:
                            self.ok += 1
                        else:
                            self.errors.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    with self._lock:
                        self.errors.append(repr(e))


@contextlib.contextmanager
def traffic(cluster: Cluster, threads: int = 2) -> Iterator[Traffic]:
    t = Traffic(cluster.url, cluster.model_name, threads).start()
    try:
        yield t
    finally:
        t.stop()


def prometheus_config(ports: dict[str, int]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.local.yml with each job's target moved to `ports[job]`."""
    cfg: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [f"{t.rsplit(':', 1)[0]}:{ports[job['job_name']]}" for t in sc["targets"]]
    return cfg


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets(self) -> dict[str, str]:
        """job -> health ("up", "down", "unknown") of its active target."""
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return {t["labels"]["job"]: t["health"] for t in body["data"]["activeTargets"]}


@contextlib.contextmanager
def prometheus(root: Path, ports: dict[str, int], binary: str) -> Iterator[Prometheus]:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(ports)))
    (port,) = free_ports(1)
    log = root / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    p = Prometheus(f"http://127.0.0.1:{port}", proc, log)

    def ready() -> bool:
        assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{p.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        eventually(ready, 30, "prometheus ready")
        yield p
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
