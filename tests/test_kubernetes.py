"""deploy/kubernetes/ cannot rot: every overlay renders (`kubectl kustomize`), every object
validates against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an unknown field
is an error) and the PodMonitor against the Prometheus Operator's types, the pods run the
commands and settings of `moetier up` (moetier.launch.service_specs) and docker-compose.yml
once service names are loopback, the probes ask grpc.health.v1 on the ports the services bind,
only the gateway is reachable from outside, and the resources are the ones resources.py derives
from the model."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_compose import load_compose, moetier_services
from test_compose import on_loopback as compose_on_loopback

from moetier.cli import build_parser
from moetier.launch import SERVICES, demo_model_dir, service_specs
from moetier.settings import Settings, load_settings, parse_bytes, resolve_budget

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
VERSIONS = ("1.28", "1.37")  # the oldest with the pod-index label the stores read; the newest schemas
COMPONENT = "app.kubernetes.io/component"  # its value: the settings section, compose service and job name
WORKLOADS = {"Deployment", "StatefulSet"}


def kustomize() -> list[str]:
    """`kubectl kustomize` where its kustomize reads this layout (labels, replicas, patches: v4+)."""
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl, whose `kubectl kustomize` renders the overlays (a kubectl of 1.21 or later)")
    r = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    version = json.loads(r.stdout or "{}").get("kustomizeVersion", "") if r.returncode == 0 else ""
    m = re.match(r"v(\d+)", version)
    if not m or int(m.group(1)) < 4:
        pytest.skip(f"kubectl's kustomize is {version or 'unknown'}; the overlays need v4 or later")
    return ["kubectl", "kustomize"]


_rendered: dict[str, list[dict[str, Any]]] = {}


def render(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _rendered:
        r = subprocess.run([*kustomize(), str(KUBE / "overlays" / overlay)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        _rendered[overlay] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return copy.deepcopy(_rendered[overlay])


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def workloads(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> its Deployment or StatefulSet."""
    out = {}
    for o in objs:
        if o["kind"] in WORKLOADS:
            out[o["spec"]["template"]["metadata"]["labels"][COMPONENT]] = o
    return out


def pod(w: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = w["spec"]["template"]["spec"]
    return spec


def main_container(w: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod(w)["containers"]
    return c


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions' In / NotIn / Exists) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


# ---- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_schemas(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Deployment", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget",
            "PodMonitor"} <= kinds, kinds
    for o in objs:
        what = f"{overlay}: {o['kind']}/{o['metadata']['name']}"
        if o["apiVersion"] == "monitoring.coreos.com/v1":
            model = getattr(monitoring, o["kind"]).model_validate(o)
            # the types ignore fields they do not know: a misspelt one is lost in the round trip
            assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == o, what
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{what} against Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_schema_check_can_fail() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    objs = render("demo")
    store = workloads(objs)["expert_store"]
    main_container(store)["readinessProbe"]["grpc"]["prot"] = 50053
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(store, VERSIONS[-1], strict=True)
    (pm,) = of_kind(objs, "PodMonitor")
    pm["spec"]["podMetricEndpoints"] = pm["spec"].pop("podMetricsEndpoints")
    assert monitoring.PodMonitor.model_validate(pm).model_dump(by_alias=True, exclude_unset=True, mode="json") != pm


# ---- the same commands and settings as `moetier up` and compose ------------------------------


def config_file(objs: list[dict[str, Any]], w: dict[str, Any], tmp: Path) -> tuple[Path, Path]:
    """(the path the pod reads its --config from, that file's text written under tmp)."""
    (cm,) = of_kind(objs, "ConfigMap")
    mounts = {m["name"]: m["mountPath"] for m in main_container(w)["volumeMounts"]}
    (vol,) = [v for v in pod(w)["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    (name,) = cm["data"]
    local = tmp / name
    local.write_text(cm["data"][name])
    return Path(mounts[vol["name"]]) / name, local


def service_hosts(objs: list[dict[str, Any]]) -> list[str]:
    return [s["metadata"]["name"] for s in of_kind(objs, "Service")]


def on_loopback(value: str, hosts: list[str]) -> str:
    """Service names (and a StatefulSet pod's name under its headless Service), the pod's own
    IP and the wildcard -> 127.0.0.1, ports kept."""
    names = "|".join(re.escape(h) for h in sorted(hosts, key=len, reverse=True))
    pattern = rf"(?:\$\(POD_NAME\)\.)?(?:{names})|\$\(POD_IP\)|0\.0\.0\.0"
    return re.sub(rf"(?<![\w.-])({pattern}):(\d+)\b", lambda m: f"127.0.0.1:{m.group(2)}", value)


def per_pod(settings: Settings) -> dict[str, Any]:
    """The settings less what names one pod (its id: the pod's name, where `moetier up` has one
    member of each kind)."""
    dump = settings.model_dump()
    for section in ("dense_worker", "expert_store"):
        dump[section].pop("id")
    return dump


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_what_moetier_up_runs(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    ws = workloads(objs)
    assert set(ws) == set(SERVICES)
    hosts = service_hosts(objs)
    for name in SERVICES:
        w = ws[name]
        c = main_container(w)
        config, local = config_file(objs, w, tmp_path)
        env = env_of(c)
        model_dir, data_dir = Path(env["MOETIER_MODEL__PATH"]), Path(env["MOETIER_DATA_DIR"])
        up = load_settings(local, environ={})
        assert up.data_path == data_dir, f"{name}: MOETIER_DATA_DIR is not the config file's data_dir"
        (spec,) = [s for s in service_specs(up, model_dir, config) if s.name == name]
        assert c["command"] == ["moetier", *spec.argv], name
        assert {k: env[k] for k in spec.env} == spec.env, name
        moetier_env = {k: v for k, v in env.items() if k.startswith("MOETIER_")}
        for key, value in moetier_env.items():
            local_value = on_loopback(value, hosts)
            assert "$(" not in local_value or key.endswith("__ID"), f"{name}: {key}={value}"
        mine = load_settings(local, environ={k: on_loopback(v, hosts) for k, v in moetier_env.items()})
        assert per_pod(mine) == per_pod(load_settings(local, environ=spec.env)), name
        # every MOETIER_* of a pod names a setting (load_settings refuses none, so check the names)
        for key in moetier_env:
            model: Any = Settings
            for part in key.removeprefix("MOETIER_").lower().split("__"):
                assert part in model.model_fields, f"{name}: {key} names no setting"
                model = model.model_fields[part].annotation

        # the init step is up's first (launch.ensure_model, `moetier up --prepare`), with up's
        # environment: data_dir, and the model only where the overlay names one
        if name == "router":
            assert not pod(w).get("initContainers"), "the router reads no model"
            continue
        (init,) = pod(w)["initContainers"]
        args = build_parser().parse_args(init["command"][1:])
        assert init["command"][0] == "moetier" and (args.command, args.prepare) == ("up", True), name
        init_env = env_of(init)
        assert init_env["MOETIER_DATA_DIR"] == str(data_dir), name
        prepared = load_settings(environ=init_env)
        assert (prepared.model.path or demo_model_dir(prepared)) == model_dir, name
        assert set(init_env) <= {"MOETIER_DATA_DIR", "MOETIER_MODEL__PATH"}, name
        mount = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}.items() <= mount.items(), name


def test_demo_overlay_runs_what_compose_runs(tmp_path: Path) -> None:
    """Service for service, the demo overlay's settings are docker-compose.yml's."""
    objs = render("demo")
    ws, hosts = workloads(objs), service_hosts(objs)
    compose = moetier_services(load_compose())
    for name in SERVICES:
        c = main_container(ws[name])
        _, local = config_file(objs, ws[name], tmp_path)
        mine = load_settings(local, environ={k: on_loopback(v, hosts) for k, v in env_of(c).items()
                                             if k.startswith("MOETIER_")})
        theirs = load_settings(environ={k: compose_on_loopback(v) for k, v in compose[name]["environment"].items()})
        assert per_pod(mine) == per_pod(theirs), name
        assert c["command"][:2] == compose[name]["command"], name
        for init in pod(ws[name]).get("initContainers", []):  # compose's model service, in each pod
            assert (init["command"], env_of(init)) == (compose["model"]["command"], compose["model"]["environment"])


# ---- probes, ports, metrics ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_ports_are_the_services(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    ws = workloads(objs)
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    for name, w in ws.items():
        c = main_container(w)
        _, local = config_file(objs, w, tmp_path)
        s = load_settings(local, environ={k: v for k, v in env_of(c).items() if k.startswith("MOETIER_")})
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert pod(w)["enableServiceLinks"] is False, (
            f"{name}: Kubernetes would set MOETIER_<SERVICE>_PORT variables, read as settings")
        if name == "gateway":
            assert ports == {"http": int(s.gateway.bind.rsplit(":", 1)[1])}
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # up's health check
            for probe in ("startupProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["port"] == "http", probe
            continue
        ep = getattr(s, name)
        bind_port = int(ep.bind.rsplit(":", 1)[1])
        assert ports == {"grpc": bind_port, "metrics": ep.metrics_port}, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": bind_port}, f"{name} {probe}: grpc.health.v1 on the bind port"
        # the address others dial is a Service of this component, on the bind port
        host, port = ep.address.rsplit(":", 1)
        assert int(port) == bind_port, name
        if not host.startswith("$(POD_IP)"):
            svc = services[host.removeprefix("$(POD_NAME).")]
            assert matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), name
            assert [p["port"] for p in svc["spec"]["ports"]] == [bind_port], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_monitor_scrapes_every_service(overlay: str) -> None:
    objs = render(overlay)
    (pm,) = of_kind(objs, "PodMonitor")
    endpoints = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    for name, w in workloads(objs).items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(pm["spec"]["selector"], labels), name
        assert labels[pm["spec"]["jobLabel"]] == name  # the job names of deploy/prometheus/ and the dashboards
        scraped = [p for p in main_container(w)["ports"] if p["name"] in endpoints]
        assert len(scraped) == 1, f"{name}: scraped on {scraped}"


# ---- stores, disruption, network ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stores_are_a_stateful_set_with_a_volume_each(overlay: str) -> None:
    objs = render(overlay)
    store = workloads(objs)["expert_store"]
    assert store["kind"] == "StatefulSet"
    (claim,) = store["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    c = main_container(store)
    data = Path(env_of(c)["MOETIER_DATA_DIR"])
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[str(data)] == claim["metadata"]["name"]
    assert Path(env_of(c)["MOETIER_MODEL__PATH"]).is_relative_to(data), "the model lies on the store's own volume"
    headless = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}[store["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    # the per-replica shard assignment (a placeholder until sharded stores have settings)
    (shard,) = [e for e in c["env"] if e["name"] == "SHARD_INDEX"]
    assert shard["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    (pdb,) = of_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": store["spec"]["selector"]}
    others = [w for n, w in workloads(objs).items() if n != "expert_store"]
    assert not any(matches(pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]) for w in others)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_exposes_only_the_gateway(overlay: str) -> None:
    objs = render(overlay)
    policies = of_kind(objs, "NetworkPolicy")
    ours = {"app.kubernetes.io/part-of": "moetier"}
    for name, w in workloads(objs).items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        port_names = {p["name"] for p in main_container(w)["ports"]}
        selecting = [p for p in policies if matches(p["spec"]["podSelector"], labels)]
        assert selecting and all("Ingress" in p["spec"]["policyTypes"] for p in selecting), name
        rules = [r for p in selecting for r in p["spec"].get("ingress", [])]
        open_to_all = [r for r in rules if not r.get("from")]
        if name == "gateway":
            assert [[p["port"] for p in r["ports"]] for r in open_to_all] == [["http"]]
            continue
        assert not open_to_all, f"{name} takes connections from anywhere"
        for r in rules:
            for peer in r["from"]:
                if "namespaceSelector" in peer:  # Prometheus: the metrics port alone
                    assert [p["port"] for p in r["ports"]] == ["metrics"] and "metrics" in port_names, (name, r)
                else:
                    # a pod of this namespace that is one of ours
                    assert set(peer) == {"podSelector"}, (name, peer)
                    assert peer["podSelector"]["matchLabels"].items() >= ours.items(), (name, peer)


# ---- resources -----------------------------------------------------------------------------------


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kube_resources", KUBE / "resources.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up as they are made
    spec.loader.exec_module(module)
    return module


def test_resources_are_derived_from_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    gen = generator()
    assert gen.main(["--check"]) == 0, capsys.readouterr().err
    assert {o.name for o in gen.OVERLAYS} == set(OVERLAYS)
    glm = next(o for o in gen.OVERLAYS if o.name == "glm-5")
    sizes = gen.sizes_of_preset(glm.preset)
    settings = load_settings(KUBE / "overlays" / "glm-5" / "moetier.yml", environ={})
    ws = workloads(render("glm-5"))
    store, worker = main_container(ws["expert_store"]), main_container(ws["dense_worker"])
    limit = parse_bytes(store["resources"]["limits"]["memory"].replace("Mi", "MiB"))
    assert limit >= resolve_budget(settings.model.expert_cache, sizes.expert_bytes), "the RAM tier fits the pod"
    assert store["resources"]["requests"]["memory"] == store["resources"]["limits"]["memory"]
    claim = ws["expert_store"]["spec"]["volumeClaimTemplates"][0]["spec"]
    volume = parse_bytes(claim["resources"]["requests"]["storage"].replace("Gi", "GiB"))
    assert volume >= sizes.expert_bytes + sizes.dense_bytes, "a full copy of the model fits each store's volume"
    assert claim["storageClassName"] == glm.storage_class
    worker_limit = parse_bytes(worker["resources"]["limits"]["memory"].replace("Mi", "MiB"))
    kv = settings.inference.max_batch_size * settings.inference.max_seq_len * sizes.kv_bytes_per_token
    assert worker_limit >= sizes.dense_bytes + kv
