"""docker-compose.yml cannot rot: it validates (`docker-compose config`), its commands and
environment are the ones `moetier up` runs (moetier.launch.service_specs, modulo hosts and
paths), and it runs: its services' exact commands and environment as local processes (service
hostnames and 0.0.0.0 on loopback, every port a container listens on moved to a free one,
the volumes on temporary directories, `moetier` this environment's), in compose's order, gated
by its own healthcheck commands, until a chat completes through the gateway.
tests/test_compose_engine.py builds the image and brings the stack up on a Docker engine."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from helpers_observability import free_ports
from helpers_up import eventually, moetier_argv

from moetier.cli import build_parser
from moetier.launch import SERVICES, demo_model_dir, service_specs
from moetier.settings import Settings, load_settings

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
OBSERVE = ROOT / "deploy" / "compose.observe.yml"
IMAGE = "moetier:latest"
VOLUMES = ("/data/models", "/data", "/mirror")  # where the moetier services' volumes are mounted (longest first)
HOSTS = ("router", "dense_worker", "expert_store", "gateway", "0.0.0.0", "127.0.0.1", "localhost")
HOST_PORT = re.compile(r"\b(?:" + "|".join(re.escape(h) for h in HOSTS) + r"):(\d+)\b")


# ---- the compose file as compose reads it ---------------------------------------------------

_VAR = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default} (unset or empty),
    ${VAR-default} (unset), ${VAR:?error}, ${VAR?error}."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name, op, arg = m.group(2) or m.group(5), m.group(3), m.group(4) or ""
        value = env.get(name)
        if (op in (":-", ":?") and not value) or (op in ("-", "?") and value is None):
            if op.endswith("?"):
                raise ValueError(f"{name}: {arg or 'required'}")
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def _resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_resolve(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _resolve(v, env) for k, v in node.items()}
    return node


def load_compose(env: Mapping[str, str] | None = None, path: Path = COMPOSE) -> dict[str, Any]:
    """The file with anchors and merge keys resolved (YAML's, as compose's) and variables
    substituted from `env` (default: none set, so every default applies)."""
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    resolved: dict[str, Any] = _resolve(data, env or {})
    return resolved


def moetier_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == IMAGE}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {path}"
        if name not in order:
            for dep in depends_on(services[name]):
                visit(dep, (*path, name))
            order.append(name)

    for name in services:
        visit(name, ())
    return order


def compose_variables() -> set[str]:
    return {m.group(2) or m.group(5) for f in (COMPOSE, OBSERVE) for m in _VAR.finditer(f.read_text())
            if not m.group(1)}


def on_loopback(text: str, ports: Mapping[int, int] | None = None) -> str:
    """Service hostnames and wildcard binds -> 127.0.0.1 (ports kept, or moved as `ports` says)."""
    return HOST_PORT.sub(lambda m: f"127.0.0.1:{(ports or {}).get(int(m.group(1)), int(m.group(1)))}", text)


def compose_cli() -> list[str] | None:
    """docker-compose (Debian's package validates without an engine), else the docker plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                  timeout=30).returncode == 0:
        return ["docker", "compose"]
    return None


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without MOETIER_* (so compose's defaults apply), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}, **extra}


# ---- validation ------------------------------------------------------------------------------

VARIANTS = [{}, {"MOETIER_MODEL_NAME": "glm", "MOETIER_MIRRORS": '["/mirror"]', "MOETIER_PORT": "8123"}]


@pytest.mark.parametrize("variables", VARIANTS, ids=["defaults", "set"])
def test_docker_compose_config_validates_and_reads_as_ours(variables: dict[str, str]) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed (Debian: apt-get install "
                    "docker-compose; .ci/run installs it)")
    for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(OBSERVE)]):
        r = subprocess.run([*cli, *files, "config", "-q"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env=clean_env(**variables))
        assert r.returncode == 0, r.stderr
    # compose's own reading of the file is the one these tests run
    r = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=clean_env(**variables))
    assert r.returncode == 0, r.stderr
    theirs = yaml.safe_load(r.stdout)["services"]
    ours = load_compose(variables)["services"]
    for name, service in moetier_services(load_compose(variables)).items():
        assert theirs[name]["command"] == service["command"], name
        assert {k: str(v) for k, v in theirs[name]["environment"].items()} == service["environment"], name
        assert set(depends_on(theirs[name])) == set(depends_on(ours[name])), name
        if "healthcheck" in service:
            assert theirs[name]["healthcheck"]["test"] == service["healthcheck"]["test"], name


def test_compose_variables_are_not_settings() -> None:
    """A variable meant for compose that a shell exports must not change (or break) what
    moetier itself reads: none of them may name a settings section or field."""
    names = compose_variables()
    assert {"MOETIER_MODELS_DIR", "MOETIER_MODEL_NAME", "MOETIER_MIRROR_DIR", "MOETIER_MIRRORS",
            "MOETIER_PORT"} <= names
    default = load_settings(environ={}).model_dump()
    for name in names:
        assert name.removeprefix("MOETIER_").lower() not in Settings.model_fields, name
        assert load_settings(environ={name: "x"}).model_dump() == default, name


def test_every_service_variable_is_a_setting() -> None:
    """Each MOETIER_* the services get names a setting (a misspelt one would be ignored) and
    holds a valid value for it."""
    for service in moetier_services(load_compose()).values():
        for key, value in service["environment"].items():
            assert key.startswith("MOETIER_"), key
            model: Any = Settings
            for part in key.removeprefix("MOETIER_").lower().split("__"):
                assert part in model.model_fields, f"{key}: no setting {part!r}"
                model = model.model_fields[part].annotation
            load_settings(environ={key: value})


# ---- the same commands and environment as `moetier up` ---------------------------------------


def test_compose_runs_what_moetier_up_runs() -> None:
    services = moetier_services(load_compose())
    env = services["router"]["environment"]
    model_dir, data_dir = Path(env["MOETIER_MODEL__PATH"]), Path(env["MOETIER_DATA_DIR"])
    # `moetier up` with no config file, its data_dir and model at compose's paths
    up_settings = load_settings(environ={"MOETIER_DATA_DIR": str(data_dir)})
    specs = service_specs(up_settings, model_dir, None)
    assert [s.name for s in specs] == list(SERVICES)
    assert set(services) == {"model", *SERVICES}

    for spec in specs:
        service = services[spec.name]
        assert service["command"] == ["moetier", *spec.argv], spec.name
        assert service["environment"] == env, f"{spec.name}: the services share one environment, as under up"
        assert {k: service["environment"][k] for k in spec.env} == spec.env, spec.name
        # Every setting the service ends up with is the one it gets under `moetier up`, once the
        # service hostnames and 0.0.0.0 are loopback.
        under_compose = load_settings(environ={k: on_loopback(v) for k, v in service["environment"].items()})
        under_up = load_settings(environ=spec.env)
        assert under_compose.model_dump() == under_up.model_dump(), spec.name
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and [test[1], *(on_loopback(a) for a in test[2:])] == ["moetier", *spec.health_argv]

    # compose's start order is up's, each service waiting for the one before to be healthy
    assert depends_on(services["router"]) == {"model": "service_completed_successfully"}
    for before, after in itertools.pairwise(SERVICES):
        assert depends_on(services[after]) == {before: "service_healthy"}, after

    # the `model` init service is up's own first step (launch.ensure_model, `moetier up --prepare`)
    # run with up's environment: data_dir alone, no model named, so it prepares the demo model
    # exactly where the services look for it
    model = services["model"]
    assert model["command"][0] == "moetier" and model.get("restart") == "no"
    args = build_parser().parse_args(model["command"][1:])
    assert (args.command, args.prepare, args.model, args.config) == ("up", True, None, None)
    assert model["environment"] == {"MOETIER_DATA_DIR": str(data_dir)}
    assert model_dir == demo_model_dir(load_settings(environ=model["environment"]))
    assert model["volumes"] == services["router"]["volumes"]
    # published: the gateway alone
    assert [n for n, s in load_compose()["services"].items() if s.get("ports")] == ["gateway"]


# ---- compose's services as local processes ---------------------------------------------------


@dataclass
class LocalCompose:
    """docker-compose.yml's moetier services run here, one process group each."""

    services: dict[str, dict[str, Any]]
    ports: dict[int, int]  # container port -> the loopback port it has here
    dirs: dict[str, Path]  # volume mount point -> directory here
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]]

    def local(self, text: str) -> str:
        text = on_loopback(text, self.ports)
        return re.sub(r"(?<![\w.])(" + "|".join(VOLUMES) + r")(?=/|$|\"|')",
                      lambda m: str(self.dirs[m.group(1)]), text)

    def argv(self, command: list[str]) -> list[str]:
        assert command[0] == "moetier", command
        return [*moetier_argv(), *(self.local(a) for a in command[1:])]

    def env(self, name: str) -> dict[str, str]:
        env = clean_env(**{k: self.local(v) for k, v in self.services[name]["environment"].items()})
        # Ports a container listens on that the file leaves at their defaults (each container has
        # a network namespace of its own; here they share one, so these move too).
        for section in ("router", "dense_worker", "expert_store"):
            default = Settings.model_fields[section].default.metrics_port
            env[f"MOETIER_{section.upper()}__METRICS_PORT"] = str(self.ports[default])
        return env

    def start(self, name: str) -> None:
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(self.argv(self.services[name]["command"]), stdout=log,
                                                stderr=subprocess.STDOUT, env=self.env(name),
                                                start_new_session=True)

    def tail(self, name: str) -> str:
        return f"--- {name} ---\n" + "\n".join((self.logs / f"{name}.log").read_text(errors="replace")
                                                .splitlines()[-25:])

    def healthy(self, name: str) -> bool:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.tail(name)}"
        hc = self.services[name]["healthcheck"]
        r = subprocess.run(self.argv(hc["test"][1:]), capture_output=True, env=self.env(name),
                           timeout=_seconds(hc["timeout"]) + 10)
        return r.returncode == 0

    def completed(self, name: str, within_s: float) -> None:
        code = self.procs[name].wait(within_s)
        assert code == 0, f"{name} exited with {code}\n{self.tail(name)}"

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2)]


@contextlib.contextmanager
def local_compose(root: Path) -> Iterator[LocalCompose]:
    compose = load_compose()
    services = moetier_services(compose)
    mounts = {v.split(":")[1] for s in services.values() for v in s["volumes"]}
    assert mounts == set(VOLUMES), f"a volume this test does not map: {mounts}"
    text = json.dumps(services)
    container_ports = {int(p) for p in HOST_PORT.findall(text)}
    container_ports |= {Settings.model_fields[s].default.metrics_port
                        for s in ("router", "dense_worker", "expert_store")}
    ports = dict(zip(sorted(container_ports), free_ports(len(container_ports)), strict=True))
    dirs = {v: root / v.strip("/") for v in VOLUMES}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir()
    lc = LocalCompose(services, ports, dirs, root / "logs", {})
    try:
        yield lc
    finally:
        lc.stop()


def test_compose_file_runs_as_local_processes(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with local_compose(tmp_path) as lc:
        for name in start_order(lc.services):
            for dep, condition in depends_on(lc.services[name]).items():
                hc = lc.services[dep].get("healthcheck", {})
                if condition == "service_completed_successfully":
                    lc.completed(dep, 180)
                elif condition == "service_healthy":
                    # compose polls every `interval` up to `retries` times; the same check, sooner
                    eventually(lambda dep=dep: lc.healthy(dep),  # type: ignore[misc]
                               _seconds(hc["interval"]) * hc["retries"], f"{dep} healthy", every_s=0.5)
            lc.start(name)
        for name, service in lc.services.items():
            if "healthcheck" in service:
                eventually(lambda name=name: lc.healthy(name),  # type: ignore[misc]
                           _seconds(service["healthcheck"]["interval"]) * service["healthcheck"]["retries"],
                           f"{name} healthy", every_s=0.5)
        t_up = time.monotonic()
        assert (lc.dirs["/data/models"] / "demo" / "moetier.json").is_file()  # built by the `model` service
        gateway_port = int(lc.services["gateway"]["ports"][0].rsplit(":", 1)[1])
        r = httpx.post(f"http://127.0.0.1:{lc.ports[gateway_port]}/v1/chat/completions", timeout=60,
                       json={"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text + "".join(lc.tail(n) for n in lc.procs)
        assert r.json()["choices"][0]["message"]["content"]
        assert (lc.dirs["/data"] / "prefix-cache").is_dir()  # the data volume is where the services keep state
    print(f"\ncompose as local processes: healthy in {t_up - t0:.1f} s, chat in {time.monotonic() - t_up:.1f} s")
