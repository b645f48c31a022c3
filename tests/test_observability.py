"""The observability files without a cluster: the Prometheus configs (promtool, targets in
step with the settings and docker-compose.yml), the Grafana provisioning and dashboards
(generated from deploy/grafana/generate.py, well-formed, valid PromQL), and every metric
a dashboard uses exists in some service's metrics module and is documented."""

from __future__ import annotations

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

from moetier.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
JOBS = ("gateway", "router", "dense_worker", "expert_store")  # job name = settings section = compose service
# The only Grafana variable the expressions may use, and what stands in for it outside Grafana.
RATE_INTERVAL = "$__rate_interval"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def expressions() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every target of every panel."""
    return [(name, p["title"], t["expr"]) for name, board in dashboards().items() for p in panels(board)
            for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bmoetier_[a-z0-9_]+", expr))


def default_ports() -> dict[str, int]:
    s = load_settings(environ={})
    return {"gateway": int(s.gateway.bind.rsplit(":", 1)[1]), "router": s.router.metrics_port,
            "dense_worker": s.dense_worker.metrics_port, "expert_store": s.expert_store.metrics_port}


def scrape_targets(path: Path) -> dict[str, list[str]]:
    cfg = yaml.safe_load(path.read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in cfg["scrape_configs"]}


# ---- Prometheus ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["prometheus.local.yml", "prometheus.compose.yml"])
def test_promtool_accepts_the_config(name: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    r = subprocess.run([promtool, "check", "config", str(PROM / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_local_config_scrapes_the_default_ports_of_moetier_up() -> None:
    ports = default_ports()
    assert scrape_targets(PROM / "prometheus.local.yml") == {job: [f"127.0.0.1:{ports[job]}"] for job in JOBS}
    interval = yaml.safe_load((PROM / "prometheus.local.yml").read_text())["global"]["scrape_interval"]
    assert interval == "2s"  # short enough for the live test to see several scrapes


def test_compose_config_scrapes_the_compose_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    ports = default_ports()
    targets = scrape_targets(PROM / "prometheus.compose.yml")
    assert targets == {job: [f"{job}:{ports[job]}"] for job in JOBS}
    for job in JOBS:
        assert job in compose["services"], f"no compose service {job}"
    mount = "./deploy/prometheus/prometheus.compose.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in compose["services"]["prometheus"]["volumes"]
    # Services bind every interface in compose, so Prometheus reaches their metrics ports.
    env = compose["x-moetier"]["environment"]
    for job in ("router", "dense_worker", "expert_store"):
        assert env[f"MOETIER_{job.upper()}__BIND"].startswith("0.0.0.0:")


# ---- Grafana -----------------------------------------------------------------------------

def test_provisioning_matches_compose() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    (ds,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert (ds["type"], ds["uid"], ds["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    (prov,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/moetier.yml").read_text())["providers"]
    assert prov["type"] == "file" and prov["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboards_are_generated() -> None:
    rendered = generator().render()
    assert set(rendered) == set(dashboards()), "a dashboard file without generator entry, or the reverse"
    for name, text in rendered.items():
        assert (GRAFANA / "dashboards" / name).read_text() == text, (
            f"{name} differs from deploy/grafana/generate.py: run python deploy/grafana/generate.py")


def test_dashboards_are_well_formed() -> None:
    boards = dashboards()
    titles = {b["title"] for b in boards.values()}
    assert {"moetier · Expert cache", "moetier · Disk", "moetier · Serving"} <= titles
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert board["templating"]["list"] == []
        for p in panels(board):
            where = f"{name} / {p['title']}"
            g = p["gridPos"]
            assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, where
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, where
            assert p["targets"], f"{where}: no query"
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "prometheus", where
                assert set(re.findall(r"\$\w+", t["expr"])) <= {RATE_INTERVAL}, f"{where}: {t['expr']}"
                assert metric_names(t["expr"]), f"{where}: no moetier metric in {t['expr']}"


def test_dashboards_cover_the_issue() -> None:
    """The panels the observability issue asks for, by the metrics they must show."""
    used = {name: set().union(*(metric_names(e) for n, _, e in expressions() if n == name))
            for name in dashboards()}
    required = {
        "expert-cache.json": {"moetier_expert_store_hits_total", "moetier_expert_store_misses_total",
                              "moetier_expert_store_prefetch_useful_total",
                              "moetier_expert_store_prefetch_wasted_total", "moetier_expert_store_resident_bytes",
                              "moetier_expert_store_budget_bytes", "moetier_expert_store_evictions_total",
                              "moetier_expert_store_disk_read_bytes_total", "moetier_gateway_generation_tokens_total"},
        "disk.json": {"moetier_expert_store_disk_read_bytes_total", "moetier_expert_store_disk_reads_total",
                      "moetier_expert_store_disk_read_seconds_bucket", "moetier_expert_store_disk_read_errors_total",
                      "moetier_expert_store_disk_checksum_failures_total", "moetier_expert_store_disk_ok"},
        "serving.json": {"moetier_gateway_generation_tokens_total", "moetier_gateway_time_to_first_token_seconds_bucket",
                         "moetier_gateway_inter_token_latency_seconds_bucket", "moetier_gateway_queue_time_seconds_bucket",
                         "moetier_gateway_running_requests", "moetier_router_queue_depth"},
    }
    for name, metrics in required.items():
        assert metrics <= used[name], f"{name} lacks {sorted(metrics - used[name])}"
    kinds = {p["title"]: p["type"] for p in panels(dashboards()["expert-cache.json"])}
    assert kinds["Misses per layer (layer × time)"] == "heatmap"


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each expression as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    rules = [{"record": f"moetier:check:{i}", "expr": expr.replace(RATE_INTERVAL, "1m")}
             for i, (_, _, expr) in enumerate(expressions())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- every metric: exported by a service, documented ----------------------------------------

def service_registries() -> dict[str, Any]:
    """Each service's metrics registry, built the way the service builds it."""
    from moetier.store.stats import DiskStats, IOStats, TierStats
    from services.dense_worker.metrics import WorkerMetrics
    from services.expert_store.metrics import StoreMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.router.metrics import RouterMetrics

    def tier_stats() -> TierStats:
        return TierStats(policy="lru", budget_bytes=1 << 20, hits={1: 0}, misses={1: 0},
                         prefetch_useful_by_layer={1: 0}, prefetch_wasted_by_layer={1: 0},
                         io=IOStats(depth=1, disks=[DiskStats("primary", "/x", "primary")]))

    return {"gateway": GatewayMetrics().registry, "router": RouterMetrics().registry,
            "dense_worker": WorkerMetrics().registry, "expert_store": StoreMetrics(tier_stats, [1], "lru").registry}


def exported() -> dict[str, dict[str, str]]:
    """service -> {metric name as scraped (counters with _total) -> type}, moetier_* only."""
    out: dict[str, dict[str, str]] = {}
    for service, registry in service_registries().items():
        families = {}
        for fam in registry.collect():
            if fam.name.startswith("moetier_"):
                families[fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
        out[service] = families
    return out


def sample_names(name: str, kind: str) -> set[str]:
    """The series names Prometheus stores for one metric."""
    return {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}


def test_dashboard_metrics_exist_in_the_services() -> None:
    series = {s for families in exported().values() for n, k in families.items() for s in sample_names(n, k)}
    unknown = {f"{board} / {title}: {m}" for board, title, expr in expressions() for m in metric_names(expr)
               if m not in series}
    assert not unknown, "dashboard metrics no service exports:\n" + "\n".join(sorted(unknown))


def test_metric_names_follow_the_design() -> None:
    """moetier_<service>_<name>_<unit>: counters end in _total, histograms name their unit."""
    for service, families in exported().items():
        for name, kind in families.items():
            assert re.fullmatch(f"moetier_{service}_[a-z0-9_]+", name), f"{name}: not moetier_{service}_*"
            if kind == "counter":
                assert name.endswith("_total"), name
            if kind == "histogram":
                assert name.endswith(("_seconds", "_bytes", "_rows", "_sequences", "_tokens")), f"{name}: no unit"


def test_every_metric_is_documented() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    rows = dict(re.findall(r"^\| `(moetier_[a-z0-9_]+)` \| (\w+) \|", doc, flags=re.M))
    for service, families in exported().items():
        for name, kind in families.items():
            assert name in rows, f"{service}: {name} is not in docs/observability.md"
            assert rows[name] == kind, f"{name}: documented as {rows[name]}, exported as {kind}"
    known = {n for families in exported().values() for n in families}
    assert not set(rows) - known, f"documented but not exported: {sorted(set(rows) - known)}"


def test_every_panel_is_documented() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    for name, board in dashboards().items():
        assert f"`{name}`" in doc, name
        for p in panels(board):
            assert f"| {p['title']} | {p['type']} |" in doc, f"{name} / {p['title']} is not in docs/observability.md"
