"""docker-compose.yml on a real Docker engine, with nothing from an image registry or PyPI
inside a container.

The test starts a Docker engine of its own (Debian's docker.io: `dockerd --iptables=false
--ip-masq=false --bridge=none`, its own data root and socket; user-defined bridge networks with
container DNS and ports published through docker-proxy work without iptables), makes the base
image from Debian's packages (mmdebstrap, `docker import`) and the wheelhouse on this host
(`pip wheel`), builds deploy/Dockerfile on them through compose (BASE_IMAGE build argument,
deploy/wheels/), runs the stack with the observe overlay's Prometheus (Debian's `prometheus` in
the same base image), chats through the published gateway port with the OpenAI SDK, checks that
Prometheus scrapes all four services over the compose network, and that `docker compose down`
leaves no container, network or volume behind. It prints the build and start-up times.

Needs root, dockerd, mmdebstrap, docker-compose and a reachable Debian mirror and PyPI on the
host (.ci/run installs the packages); skips naming what is missing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_observability import eventually, free_ports
from test_compose import COMPOSE, OBSERVE, ROOT, clean_env, compose_cli

pytestmark = pytest.mark.timeout(1500)

BASE_IMAGE = "moetier-ci-base:bookworm"
# Debian's packages the base needs: Python with venv and headers, gcc for the fast kernels,
# and Prometheus for the observe overlay.
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "prometheus")
# Files the images never read: documentation, and the JavaScript of Prometheus's web pages
# (libjs-moment-timezone alone unpacks 218 MB; the test uses Prometheus's HTTP API).
DPKG_OPTIONS = ("force-unsafe-io", "path-exclude=/usr/share/javascript/*", "path-exclude=/usr/share/doc/*",
                "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*")
SUITE = "bookworm"  # its python3 is 3.11, as the wheelhouse's below
JOBS = ("gateway", "router", "dense_worker", "expert_store")  # compose services = Prometheus job names
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "dockerd and mmdebstrap need root here"
    for tool, package in (("dockerd", "docker.io"), ("mmdebstrap", "mmdebstrap")):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}") is None:
            return f"no {tool} (Debian: apt-get install {package}; .ci/run installs it)"
    if compose_cli() is None:
        return "no docker-compose (Debian: apt-get install docker-compose; .ci/run installs it)"
    if sys.version_info[:2] != (3, 11):
        return (f"the wheelhouse is made by this Python ({sys.version.split()[0]}) for the image's, Debian "
                f"{SUITE}'s 3.11")
    return None


# ---- a Docker engine of the test's own -------------------------------------------------------


@dataclass
class Engine:
    root: Path
    host: str  # DOCKER_HOST
    client: Any  # docker.DockerClient

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(DOCKER_HOST=self.host, PATH=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}", **extra)


def _unmount_under(root: Path) -> None:
    """Mounts dockerd left under its directories (none after a clean stop)."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for point in sorted((p for p in points if p.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    docker = pytest.importorskip("docker")
    # short: the engine's sockets live under it (a unix socket path has at most 107 bytes)
    root = Path(tempfile.mkdtemp(prefix="mt-docker-", dir="/tmp"))
    host = f"unix://{root}/docker.sock"
    log = open(root / "dockerd.log", "wb")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none", "--data-root", str(root / "data"),
         "--exec-root", str(root / "exec"), "--pidfile", str(root / "dockerd.pid"), "-H", host],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PATH": f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}"})
    clients: list[Any] = []
    try:
        def answers() -> Any:
            assert proc.poll() is None, "dockerd exited:\n" + (root / "dockerd.log").read_text()[-3000:]
            try:  # the client asks the engine its API version as it is made
                clients.append(docker.DockerClient(base_url=host, timeout=300))
            except docker.errors.DockerException:  # not listening yet
                return None
            return clients[-1] if clients[-1].ping() else None

        yield Engine(root, host, eventually(answers, 90, "dockerd answering", every_s=0.5))
    finally:
        for client in clients:
            client.close()
        proc.send_signal(signal.SIGTERM)  # stops its containers and its containerd
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its containerd, should it outlive it
        log.close()
        _unmount_under(root)
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], timeout=600)  # faster than rmtree


# ---- what the build needs, made on this host -------------------------------------------------


def make_base_image(engine: Engine, work: Path) -> float:
    """Debian's packages as an image (mmdebstrap's root file system, `docker import`); seconds."""
    t0 = time.monotonic()
    tar = work / "rootfs.tar"
    r = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                        *(f"--dpkgopt={o}" for o in DPKG_OPTIONS), SUITE, str(tar)],
                       capture_output=True, text=True, timeout=900, env=engine.env())
    assert r.returncode == 0, f"mmdebstrap failed (is a Debian mirror reachable?):\n{r.stderr[-3000:]}"
    repository, tag = BASE_IMAGE.split(":")
    engine.client.api.import_image(src=str(tar), repository=repository, tag=tag)
    tar.unlink()
    return time.monotonic() - t0


def build_context(work: Path) -> tuple[Path, subprocess.Popen[str]]:
    """The repository's files the image and compose read, and `pip wheel` started on its way to
    filling deploy/wheels/ with the wheels of moetier's dependencies and build requirements."""
    ctx = _mkdir(work / "context")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "wheels")
    for name in ("pyproject.toml", "README.md", ".dockerignore", COMPOSE.name):
        shutil.copy2(ROOT / name, ctx / name)
    for name in ("moetier", "services", "deploy"):
        shutil.copytree(ROOT / name, ctx / name, ignore=ignore)
    wheels = ctx / "deploy" / "wheels"
    wheels.mkdir()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = project["build-system"]["requires"]
    proc = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                             "--wheel-dir", str(wheels), *build, *project["project"]["dependencies"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return ctx, proc


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# ---- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    engine: Engine
    cli: list[str]
    env: dict[str, str]
    cwd: Path

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.cli, *args], capture_output=True, text=True, timeout=timeout, cwd=self.cwd,
                              env=self.env)

    def must(self, *args: str, timeout: float = 900) -> str:
        r = self.compose(*args, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{self.logs()}"
        return r.stdout

    def logs(self) -> str:
        r = self.compose("logs", "--no-color", "--tail", "30", timeout=120)
        return r.stdout[-8000:]

    def project_objects(self, project: str) -> dict[str, list[str]]:
        label = {"label": f"com.docker.compose.project={project}"}
        c = self.engine.client
        return {"containers": [x.name for x in c.containers.list(all=True, filters=label)],
                "networks": [x.name for x in c.networks.list(filters=label)],
                "volumes": [x.name for x in c.volumes.list(filters=label)]}


def prometheus_targets(port: int) -> dict[str, dict[str, Any]]:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    return {t["labels"]["job"]: t for t in r.json()["data"]["activeTargets"]}


@pytest.fixture(scope="module")
def base_image(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> float:
    """BASE_IMAGE in the engine; the seconds it took."""
    return make_base_image(engine, tmp_path_factory.mktemp("base"))


def test_compose_stack_on_a_docker_engine(engine: Engine, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from openai import OpenAI

    t0 = time.monotonic()
    ctx, wheels = build_context(tmp_path)  # pip wheel runs while the base image is made
    try:
        t_base = request.getfixturevalue("base_image")
        _, err = wheels.communicate(timeout=900)
        assert wheels.returncode == 0, f"pip wheel failed (is PyPI reachable?):\n{err[-3000:]}"
    finally:
        if wheels.poll() is None:
            wheels.kill()
            wheels.wait()
    t_ready = time.monotonic() - t0
    cli = compose_cli()
    assert cli is not None
    models = _mkdir(tmp_path / "models")
    gateway_port, prometheus_port = free_ports(2)
    project = f"moetier-ci-{os.getpid()}"
    env = engine.env(MOETIER_BASE_IMAGE=BASE_IMAGE, MOETIER_PROMETHEUS_IMAGE=BASE_IMAGE,
                     MOETIER_MODELS_DIR=str(models), MOETIER_PORT=str(gateway_port),
                     MOETIER_PROMETHEUS_PORT=str(prometheus_port))
    stack = Stack(engine, [*cli, "-p", project, "-f", str(ctx / COMPOSE.name),
                           "-f", str(ctx / OBSERVE.relative_to(ROOT))], env, ctx)
    try:
        t0 = time.monotonic()
        stack.must("build", "model")  # one image, moetier:latest, for every moetier service
        t_build = time.monotonic() - t0
        t0 = time.monotonic()
        # gateway starts what it depends on, in order, each healthy first: model (to completion),
        # router, expert_store, dense_worker
        stack.must("up", "-d", "--no-build", "gateway", "prometheus")
        assert (models / "demo" / "moetier.json").is_file(), "the model service built no demo model"

        def healthy() -> bool:  # `up -d` returns once the gateway is started (nothing waits on it)
            try:
                return httpx.get(f"http://127.0.0.1:{gateway_port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        eventually(healthy, 300, "the gateway container answering /health", every_s=1)
        t_up = time.monotonic() - t0

        client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused", timeout=120,
                        max_retries=0)
        t0 = time.monotonic()
        chat = client.chat.completions.create(model="demo", max_tokens=8,
                                              messages=[{"role": "user", "content": "Hello"}])
        t_chat = time.monotonic() - t0
        assert chat.choices[0].message.content, chat
        assert chat.usage is not None and chat.usage.completion_tokens > 0, chat

        # Prometheus (Debian's, in the base image) scrapes each service by its compose name
        def all_up() -> dict[str, dict[str, Any]] | None:
            targets = prometheus_targets(prometheus_port)
            if set(targets) == set(JOBS) and all(t["health"] == "up" for t in targets.values()):
                return targets
            return None

        targets = eventually(all_up, 90, "Prometheus scraping all four services", every_s=2)
        for job, target in targets.items():
            assert httpx.URL(target["scrapeUrl"]).host == job, target
        r = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/query", params={"query": "up"}, timeout=10)
        assert {s["metric"]["job"]: s["value"][1] for s in r.json()["data"]["result"]} == dict.fromkeys(JOBS, "1")
        # and stores their moetier_* series
        r = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/query", timeout=10,
                      params={"query": 'count by (job) ({__name__=~"moetier_.+"})'})
        assert {s["metric"]["job"] for s in r.json()["data"]["result"]} == set(JOBS), r.text[:1000]
    except BaseException:
        print(stack.logs())
        raise
    finally:
        down = stack.compose("down", "-v", "--remove-orphans", timeout=600)
    assert down.returncode == 0, down.stderr[-3000:]
    # nothing of the stack is left: no container (running or not), network or volume
    assert stack.project_objects(project) == {"containers": [], "networks": [], "volumes": []}
    assert engine.client.containers.list() == []
    for port in (gateway_port, prometheus_port):  # docker-proxy let go of the published ports
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
    print(f"\ndocker compose: base image (mmdebstrap + import) {t_base:.0f} s, with the wheelhouse {t_ready:.0f} s, "
          f"image build {t_build:.0f} s, up until the gateway is healthy {t_up:.0f} s, first chat {t_chat:.1f} s")


GRAFANA_TAR = "MOETIER_TEST_GRAFANA_IMAGE_TAR"  # a `docker save` of compose's Grafana image, where one exists


def test_compose_grafana_on_a_docker_engine(engine: Engine, request: pytest.FixtureRequest) -> None:
    """The observe overlay's Grafana provisions the dashboards of deploy/grafana/dashboards/."""
    import yaml

    image = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["image"]
    tar = os.environ.get(GRAFANA_TAR)
    if not tar:
        pytest.skip(f"grafana: not installable here ({image} comes from an image registry, none is reachable, and "
                    f"Debian has no grafana package); {GRAFANA_TAR}=<docker save of {image}> runs it. Its "
                    "provisioning files are checked by tests/test_observability.py")
    request.getfixturevalue("base_image")  # Prometheus's
    with open(tar, "rb") as f:
        engine.client.images.load(f.read())
    cli = compose_cli()
    assert cli is not None
    grafana_port, prometheus_port = free_ports(2)
    project = f"moetier-ci-grafana-{os.getpid()}"
    env = engine.env(MOETIER_PROMETHEUS_IMAGE=BASE_IMAGE, MOETIER_GRAFANA_PORT=str(grafana_port),
                     MOETIER_PROMETHEUS_PORT=str(prometheus_port))
    stack = Stack(engine, [*cli, "-p", project, "-f", str(COMPOSE), "-f", str(OBSERVE)], env, ROOT)
    try:
        stack.must("up", "-d", "--no-build", "grafana")

        def dashboards() -> set[str] | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{grafana_port}/api/search", params={"type": "dash-db"}, timeout=5)
            except httpx.HTTPError:
                return None
            return {d["title"] for d in r.json()} if r.status_code == 200 else None

        titles = eventually(dashboards, 120, "Grafana serving its provisioned dashboards", every_s=2)
        ours = {json.loads(p.read_text())["title"] for p in (ROOT / "deploy/grafana/dashboards").glob("*.json")}
        assert titles == ours
    finally:
        stack.compose("down", "-v", "--remove-orphans", timeout=600)
    assert stack.project_objects(project) == {"containers": [], "networks": [], "volumes": []}
