"""`moetier up`: the four services as local processes, health-gated, stopped together.

The services are started with the same commands docker-compose.yml runs
(`moetier router`, `moetier expert-store`, `moetier dense-worker`, `moetier
gateway`), configured the same way: one YAML file (`--config`) plus MOETIER_*
environment variables. tests/test_compose.py holds the two in step.

What `moetier up` does, in order:
- refuses to start if any address it would listen on (the four binds, the three metrics
  ports) is taken, naming them: gRPC would otherwise let a second server share a port;
- model: `model.path` (which must be a container), else the demo model under
  data_dir/models/demo, built once (atomically) on first use;
- starts router, expert store, dense worker, gateway, each in a session of its own (so a
  terminal's Ctrl-C reaches only `moetier up`), logging to data_dir/logs/<service>.log, each
  one healthy (grpc.health.v1, or the gateway's /health) before the next starts; prints each
  one's pid, then the URL and a curl that works;
- supervises: SIGINT, SIGTERM or SIGHUP stops the children in reverse order (SIGTERM, then
  SIGKILL after a grace period) and exits 0; a child that exits on its own stops the others
  and `moetier up` exits 1 after printing that child's log tail. A failed start stops what
  was started and exits 1 with the failing service's log tail;
- children die with it: on Linux each child asks the kernel for SIGTERM when `moetier up`
  dies (PR_SET_PDEATHSIG), so even a SIGKILL of `moetier up` leaves no service running.
Tests: tests/test_up.py (a running cluster) and tests/test_up_lifecycle.py (the supervisor).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moetier.errors import MoetierError, Unavailable
from moetier.lifeline import parent_env
from moetier.settings import Settings

log = logging.getLogger(__name__)

DEMO_PRESET = "demo"
# Start order; shutdown runs in reverse. Each name is also the settings section of its endpoint.
SERVICES: tuple[str, ...] = ("router", "expert_store", "dense_worker", "gateway")
COMMANDS: dict[str, list[str]] = {
    "router": ["router"],
    "expert_store": ["expert-store"],
    "dense_worker": ["dense-worker"],
    "gateway": ["gateway"],
}


def say(text: str) -> None:
    """`moetier up`'s own lines: flushed at once, so a pipe or a log file sees them as they happen."""
    print(text, flush=True)


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]  # arguments after the `moetier` executable
    env: dict[str, str]  # MOETIER_* variables the service gets on top of the parent's environment
    health_argv: list[str]  # the same health check as a command (`moetier health ...`), as compose runs it
    health: Callable[[], bool] = field(repr=False)


def demo_model_dir(settings: Settings) -> Path:
    return settings.data_path / "models" / DEMO_PRESET


def ensure_model(settings: Settings, echo: Callable[[str], None] = say) -> Path:
    """The container to serve: settings.model.path, else the demo model (built once, atomically:
    an interrupted build is never taken for a model)."""
    if settings.model.path is not None:
        path = settings.model.path.expanduser()
        if not (path / "moetier.json").exists():
            hint = " (a Hugging Face checkpoint? convert it first: moetier convert SRC OUT)" if (
                path / "config.json").exists() else ""
            raise MoetierError(f"{path} is not a moetier container: no moetier.json{hint}")
        return path
    from moetier.engine import ensure_demo_model

    path = demo_model_dir(settings)
    if not (path / "moetier.json").is_file():
        echo(f"moetier: building the demo model in {path} (once; a few seconds)")
    return ensure_demo_model(settings, say=False)


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (bound together, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def grpc_healthy(address: str, timeout_s: float = 1.0) -> bool:
    """True when the gRPC server at `address` reports SERVING (grpc.health.v1, overall status)."""
    try:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                     timeout=timeout_s)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def http_healthy(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        # HTTPException: something that does not speak HTTP/1.1 holds the port (a gRPC server)
        return False


def gateway_url(settings: Settings) -> str:
    host, _, port = settings.gateway.bind.rpartition(":")
    host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    return f"http://{host}:{port}"


def service_specs(settings: Settings, model_dir: Path, config: Path | None) -> list[ServiceSpec]:
    """What `moetier up` starts. All services share one config file and one environment."""
    env = {"MOETIER_MODEL__PATH": str(model_dir), "MOETIER_DATA_DIR": str(settings.data_path)}
    extra = ["--config", str(config)] if config is not None else []
    specs = []
    for name in SERVICES:
        if name == "gateway":
            url = gateway_url(settings) + "/health"
            health_argv, health = ["health", "--http", url], partial(http_healthy, url)
        else:
            address = getattr(settings, name).address
            health_argv, health = ["health", address], partial(grpc_healthy, address)
        specs.append(ServiceSpec(name, [*COMMANDS[name], *extra], dict(env), health_argv, health))
    return specs


def listen_addresses(settings: Settings) -> dict[str, tuple[str, int]]:
    """Every (host, port) the four services listen on, by what listens there."""
    out: dict[str, tuple[str, int]] = {}
    for name in SERVICES:
        if name == "gateway":
            host, _, port = settings.gateway.bind.rpartition(":")
            out["gateway"] = (host.strip("[]"), int(port))
            continue
        ep = getattr(settings, name)
        host, _, port = ep.bind.rpartition(":")
        out[name] = (host.strip("[]"), int(port))
        if ep.metrics_port:
            out[f"{name} metrics"] = (host.strip("[]"), ep.metrics_port)
    return out


def busy_ports(settings: Settings) -> list[str]:
    """The listen addresses something else already holds (another `moetier up`, say). Checked
    before starting anything: gRPC servers may share a port with SO_REUSEPORT, and a health
    check answered by someone else's service must not pass for ours."""
    busy = []
    for what, (host, port) in listen_addresses(settings).items():
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not "busy"
            try:
                s.bind((host, port))
            except OSError as e:
                busy.append(f"{what} {host}:{port} ({e.strerror})")
    return busy


def curl_command(settings: Settings, model: str) -> str:
    """A one-line chat request that works against this cluster, for copying into a shell."""
    body = {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello"}]}
    auth = ' -H "Authorization: Bearer $MOETIER_GATEWAY__API_KEY"' if settings.gateway.api_key else ""
    return (f"curl {gateway_url(settings)}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


class Supervisor:
    """Owns the child processes: start in order, wait for health, stop in reverse. The children
    die with the supervisor's process (see parent_env)."""

    def __init__(self, log_dir: Path, echo: Callable[[str], None] = say) -> None:
        self.log_dir = log_dir
        self.echo = echo
        self.procs: list[tuple[ServiceSpec, subprocess.Popen[bytes], Path]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        f = open(log_path, "ab")  # noqa: SIM115 -- owned by the supervisor, closed in stop_all
        self._logs.append(f)
        env = {**os.environ, **spec.env, **parent_env(os.getpid())}
        # A new session: a Ctrl-C in the terminal reaches only `moetier up`, which forwards it
        # in shutdown order instead of every process getting it at once.
        p = subprocess.Popen([sys.executable, "-m", "moetier.cli", *spec.argv], stdout=f,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append((spec, p, log_path))
        return p

    def wait_healthy(self, spec: ServiceSpec, proc: subprocess.Popen[bytes], timeout_s: float,
                     cancelled: Callable[[], bool] = lambda: False) -> bool:
        """True once healthy; False when `cancelled()` (a signal) ends the wait first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cancelled():
                return False
            if proc.poll() is not None:
                raise Unavailable(f"{spec.name} exited with code {proc.returncode} during start-up\n"
                                  + self.tail(spec.name))
            if spec.health():
                return True
            time.sleep(0.2)
        raise Unavailable(f"{spec.name} not healthy after {timeout_s:.0f} s\n" + self.tail(spec.name))

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- last lines of {path} ---\n" + "\n".join(text)

    def dead(self) -> tuple[ServiceSpec, int] | None:
        for spec, p, _ in self.procs:
            if p.poll() is not None:
                return spec, int(p.returncode)
        return None

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM in reverse start order, each given `grace_s` (the gateway drains streams for
        up to 10 s) before SIGKILL."""
        for spec, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s; killing it", spec.name, grace_s)
                    p.kill()
                    p.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()


def run_cluster(settings: Settings, config: Path | None, *, start_timeout_s: float = 180.0,
                echo: Callable[[str], None] = say, until: Callable[[], bool] | None = None) -> int:
    """Start everything, wait for health, then supervise until a signal (or `until()` is true).

    0 after SIGINT, SIGTERM or SIGHUP (every child stopped); 1 when a child exits on its own
    (the others are stopped, its log's last lines printed); MoetierError when the start fails."""
    busy = busy_ports(settings)
    if busy:
        raise Unavailable("ports in use (another `moetier up`? stop it, or choose other ports in a --config "
                          "file, see docs/config.md): " + "; ".join(busy))
    model_dir = ensure_model(settings, echo)
    sup = Supervisor(settings.data_path / "logs", echo)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    # SIGHUP too: the children run in sessions of their own, so a closed terminal reaches only us.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for spec in service_specs(settings, model_dir, config):
            proc = sup.start(spec)
            if not sup.wait_healthy(spec, proc, start_timeout_s, cancelled=lambda: stopping):
                break
            echo(f"moetier: {spec.name:<12} ready  (pid {proc.pid}, log: {sup.log_dir / (spec.name + '.log')})")
        if not stopping:
            url = gateway_url(settings)
            name = settings.model.name or model_dir.name
            echo(f"moetier is up: {url}/v1  (model {name!r}; dashboard {url}/dashboard)")
            echo("  " + curl_command(settings, name))
            if settings.gateway.api_key:
                echo("  (gateway.api_key is set: /v1/* needs it; the curl reads it from $MOETIER_GATEWAY__API_KEY)")
            echo("Ctrl-C stops all services.")
        while not stopping and not (until and until()):
            dead = sup.dead()
            if dead is not None:
                spec, code = dead
                echo(f"moetier: {spec.name} exited with code {code}; stopping the others\n" + sup.tail(spec.name))
                return 1
            time.sleep(0.2)
        return 0
    finally:
        echo("moetier: stopping")
        sup.stop_all()
        echo("moetier: stopped")
        for s, h in old.items():
            signal.signal(s, h)
