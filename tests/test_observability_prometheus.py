"""A real Prometheus scraping the four services started as `moetier up` starts them, while
chat traffic runs through the gateway: every service answers /metrics on the port its job
in deploy/prometheus/prometheus.local.yml names, every metric a dashboard refers to exists,
and every PromQL expression of every dashboard panel returns data."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml
from helpers_observability import (
    LOCAL_CONFIG,
    SERVICES,
    build_model,
    eventually,
    local_cluster,
    prometheus,
    traffic,
)
from test_observability import RATE_INTERVAL, expressions, metric_names

pytestmark = pytest.mark.timeout(300)

# Four 2 s scrapes: every rate() has at least two samples once traffic has run that long.
WINDOW = "8s"


def test_dashboards_against_a_live_cluster(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/run "
                    "installs it)")
    t0 = time.monotonic()
    model = build_model(tmp_path / "models", "tiny-deepseek_v3")
    t_model = time.monotonic()
    # A mirror, so the disk panels have two copies; a budget above one layer's 8 experts (the
    # union of a prefill), below the model's 16, so experts keep being read and evicted.
    with local_cluster(tmp_path / "cluster", model, mirror=True, expert_cache="60%") as cluster:
        started = time.monotonic()
        ports = cluster.metrics_ports()
        jobs = [j["job_name"] for j in yaml.safe_load(LOCAL_CONFIG.read_text())["scrape_configs"]]
        assert sorted(jobs) == sorted(SERVICES)
        for job in jobs:
            r = httpx.get(f"http://127.0.0.1:{ports[job]}/metrics", timeout=5)
            assert r.status_code == 200, f"{job}: /metrics answered {r.status_code}"
            assert f"moetier_{job}_" in r.text, f"{job}: no moetier_{job}_* metric on its /metrics"

        with prometheus(tmp_path / "prometheus", ports, binary) as prom, traffic(cluster) as load:
            eventually(lambda: set(prom.targets().values()) == {"up"} and len(prom.targets()) == 4, 30,
                       "all four targets up")
            t_up = time.monotonic()
            eventually(lambda: load.ok >= 4 or load.errors, 60, "chat completions answered")
            assert not load.errors, load.errors[:3]
            t_traffic = time.monotonic()

            # Every metric a dashboard names exists in Prometheus (from some service's scrape).
            names = sorted(set().union(*(metric_names(e) for _, _, e in expressions())))

            missing: list[str] = []

            def all_exist() -> bool:
                missing[:] = [n for n in names if not prom.query(f'count({{__name__="{n}"}})')]
                return not missing

            try:
                eventually(all_exist, 20, "every dashboard metric scraped", every_s=1.0)
            except AssertionError:
                pytest.fail("metrics the dashboards use that no service exports:\n" + "\n".join(missing))

            # Every panel expression returns data (rates over a window the scrapes cover).
            def empty() -> list[str]:
                return [f"{board} / {title}: {expr}" for board, title, expr in expressions()
                        if not prom.query(expr.replace(RATE_INTERVAL, WINDOW))]

            last: list[str] = []

            def all_answer() -> bool:
                last[:] = empty()
                return not last

            try:
                eventually(all_answer, 45, "every dashboard expression returns data", every_s=1.0)
            except AssertionError:
                pytest.fail("panels without data:\n" + "\n".join(last) + "\n" + cluster.logs())

            t_data = time.monotonic()
            values = [f"{board} / {title}: " + ", ".join(
                f"{s['metric'].get(k, '') if (k := next(iter(s['metric']), '')) else ''}={float(s['value'][1]):.4g}"
                for s in prom.query(expr.replace(RATE_INTERVAL, WINDOW))[:4])
                for board, title, expr in expressions()]

            # A few values that must be sane, not just present.
            def scalar(expr: str) -> float:
                (sample,) = prom.query(expr.replace(RATE_INTERVAL, WINDOW))
                return float(sample["value"][1])

            hit_rate = next(e for b, t, e in expressions() if b == "expert-cache.json" and t == "Hit rate")
            assert 0.0 <= scalar(hit_rate) <= 1.0
            assert scalar(f"sum(rate(moetier_gateway_generation_tokens_total[{WINDOW}]))") > 0
            disks = {s["metric"]["disk"] for s in prom.query("moetier_expert_store_disk_ok")}
            assert disks == {"primary", "mirror0"}
            assert all(math.isfinite(float(s["value"][1])) for s in
                       prom.query("moetier_expert_store_resident_bytes"))
        elapsed = time.monotonic() - started
    print(f"\nlive Prometheus test: model {t_model - t0:.1f} s, cluster start {started - t_model:.1f} s, "
          f"traffic and queries {elapsed:.1f} s (targets up {t_up - started:.1f} s, first answers "
          f"{t_traffic - t_up:.1f} s, every panel with data {t_data - t_traffic:.1f} s), {load.ok} requests, "
          f"{len(expressions())} expressions")
    for line in values:
        print("  " + line)
