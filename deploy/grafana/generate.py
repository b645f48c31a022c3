"""Writes the provisioned Grafana dashboards (deploy/grafana/dashboards/*.json).

    python deploy/grafana/generate.py          # rewrite the JSON files
    python deploy/grafana/generate.py --check  # exit 1 when they differ from this file

The dashboards are data: this file lists every panel and its PromQL once, and the JSON is
generated from it, so ids, grid positions and datasource references stay consistent.
tests/test_observability.py checks that the JSON files are what this file generates and
that every expression refers to metrics the services export; the real-Prometheus test
checks that every expression returns data from a live cluster.

Rates use Grafana's $__rate_interval (the only variable the expressions may use). Hit
rates and ratios are derived here from counters; no service exports a ratio.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
OUT = Path(__file__).resolve().parent / "dashboards"
R = "$__rate_interval"
GW, RT, DW, ES = "moetier_gateway_", "moetier_router_", "moetier_dense_worker_", "moetier_expert_store_"


def rate(metric: str, by: str = "", where: str = "") -> str:
    sel = f"{metric}{{{where}}}" if where else metric
    return f"sum{f' by ({by})' if by else ''} (rate({sel}[{R}]))"


def quantile(q: float, metric: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(metric + '_bucket', ', '.join(filter(None, [by, 'le'])))})"


def ratio(num: str, den: str) -> str:
    """num / den, both rates of counters; no value (not NaN) while the denominator is 0."""
    return f"{num} / ({den} > 0)"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    kind: str = "timeseries"  # timeseries | stat | heatmap | state-timeline | bargauge
    unit: str = "short"
    description: str = ""
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    stack: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    title: str


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    out: dict[str, Any] = {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "range": True, "instant": False}
                    for i, (expr, legend) in enumerate(p.targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
    }
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 15 if p.stack else 8,
                              "showPoints": "never", "spanNulls": True,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto", "orientation": "auto"}
    elif p.kind == "heatmap":
        # One row per series (legend = the bucket name), values as they are: no re-bucketing.
        out["options"] = {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges",
                                                                       "steps": 64, "exponent": 0.5},
                          "yAxis": {"axisPlacement": "left", "reverse": False},
                          "rowsFrame": {"layout": "auto"}, "legend": {"show": True},
                          "tooltip": {"mode": "single", "yHistogram": False}}
        for t in out["targets"]:
            t["format"] = "time_series"
    elif p.kind == "state-timeline":
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                                 {"color": "green", "value": 1}]}
        defaults["mappings"] = [{"type": "value", "options": {"0": {"text": "degraded", "color": "red"},
                                                              "1": {"text": "ok", "color": "green"}}}]
        out["options"] = {"showValue": "auto", "mergeValues": True, "rowHeight": 0.8,
                          "legend": {"showLegend": False}}
    elif p.kind == "bargauge":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True}
    out["options"].update(p.extra)
    return out


def dashboard(uid: str, title: str, description: str, items: list[Panel | Row]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = row_h = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            if x:
                x, y = 0, y + row_h
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y, row_h = y + 1, 0
            continue
        if x + item.width > 24:
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel_json(item, pid, x, y))
        x += item.width
        row_h = max(row_h, item.height)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["moetier"], "editable": False,
        "schemaVersion": 39, "version": 1, "refresh": "5s", "time": {"from": "now-15m", "to": "now"},
        "timepicker": {}, "timezone": "", "graphTooltip": 1, "links": [], "annotations": {"list": []},
        "templating": {"list": []}, "panels": panels,
    }


HITS, MISSES = rate(ES + "hits_total"), rate(ES + "misses_total")
USEFUL, WASTED = rate(ES + "prefetch_useful_total"), rate(ES + "prefetch_wasted_total")


def expert_cache() -> dict[str, Any]:
    return dashboard("moetier-expert-cache", "moetier · Expert cache",
                     "The RAM tier of the expert stores: hit rate, misses, prefetch, residency, evictions.", [
        Panel("Hit rate", [(ratio(HITS, f"{HITS} + {MISSES}"), "hit rate")], kind="stat", unit="percentunit",
              min=0, max=1, width=6, height=6,
              description="Experts of each batch union found in RAM, over all MoE layers."),
        Panel("Misses / s", [(MISSES, "misses")], kind="stat", unit="ops", width=6, height=6,
              description="Experts read from disk (or joined to a read in flight) per second."),
        Panel("Expert bytes read per generated token",
              [(ratio(rate(ES + "disk_read_bytes_total"), rate(GW + "generation_tokens_total")), "bytes / token")],
              kind="stat", unit="bytes", width=6, height=6,
              description="Bytes read from every disk per token generated: what the cache did not save."),
        Panel("Resident / budget",
              [(f"sum({ES}resident_bytes) / (sum({ES}budget_bytes) > 0)", "resident")],
              kind="stat", unit="percentunit", min=0, max=1, width=6, height=6,
              description="Share of the RAM tier budget holding verified experts."),
        Row("Hits and misses"),
        Panel("Hit rate over time", [(ratio(HITS, f"{HITS} + {MISSES}"), "all layers")], unit="percentunit", min=0,
              max=1, width=12),
        Panel("Hit rate per layer",
              [(ratio(rate(ES + "hits_total", "layer"),
                      f"{rate(ES + 'hits_total', 'layer')} + {rate(ES + 'misses_total', 'layer')}"), "layer {{layer}}")],
              unit="percentunit", min=0, max=1, width=12),
        Panel("Misses per layer (layer × time)", [(rate(ES + "misses_total", "layer"), "{{layer}}")],
              kind="heatmap", unit="ops", width=16, height=10,
              description="Expert misses per second; one row per MoE layer."),
        Panel("Hits and misses / s", [(HITS, "hits"), (MISSES, "misses")], unit="ops", width=8, height=10),
        Row("Prefetch"),
        Panel("Prefetch recall and precision",
              [(ratio(rate(DW + "prefetch_hit_experts_total"), rate(DW + "prefetch_actual_experts_total")), "recall"),
               (ratio(rate(DW + "prefetch_hit_experts_total"), rate(DW + "prefetch_predicted_experts_total")),
                "precision")], unit="percentunit", min=0, max=1,
              description="The dense workers' predictions (next layer's gate on the current hidden state): "
                          "recall = used experts that were hinted / used; precision = hinted that were used."),
        Panel("Prefetch waste",
              [(ratio(WASTED, f"{USEFUL} + {WASTED}"), "wasted share"),
               (ratio(USEFUL, f"{USEFUL} + {MISSES}"), "misses prefetched")], unit="percentunit", min=0, max=1,
              description="Store side: prefetched experts evicted unused, as a share of prefetches that ended "
                          "either way; and of the experts that came from disk, the share a hint read first."),
        Panel("Prefetch hints / s",
              [(rate(ES + "prefetch_hints_total"), "hinted"), (rate(ES + "prefetch_queued_total"), "read"),
               (rate(ES + "prefetch_dropped_total"), "dropped"), (USEFUL, "useful"), (WASTED, "wasted")],
              unit="ops"),
        Row("Residency"),
        Panel("Resident bytes vs budget",
              [(f"sum({ES}resident_bytes)", "resident"), (f"sum({ES}loading_bytes)", "being read"),
               (f"sum({ES}budget_bytes)", "budget")], unit="bytes", min=0, width=12),
        Panel("Evictions / s", [(rate(ES + "evictions_total"), "evictions")], unit="ops", width=6),
        Panel("Experts in RAM", [(f"sum({ES}resident_experts)", "resident"),
                                 (f"sum({ES}pinned_experts)", "pinned by running computes")], width=6),
        Panel("Miss wait (quantiles)",
              [(quantile(q, ES + "miss_wait_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
              unit="s", width=12, description="Time a batch with misses waited for its reads."),
        Panel("Expert call time (p50)",
              [(quantile(0.5, DW + "expert_call_seconds"), "ComputeExperts round trip (dense worker)"),
               (quantile(0.5, ES + "load_seconds"), "making the union resident (store)"),
               (quantile(0.5, ES + "compute_seconds"), "expert FFNs (store)")],
              unit="s", width=12, description="One MoE layer of one step; the gap between the round trip and "
                                              "the store's parts is the service hop."),
    ])


def disk() -> dict[str, Any]:
    return dashboard("moetier-disk", "moetier · Disk", "Expert reads per copy (primary and mirrors).", [
        Panel("Read bandwidth per disk", [(rate(ES + "disk_read_bytes_total", "disk"), "{{disk}}")],
              unit="Bps", stack=True, width=12),
        Panel("Read IOPS per disk", [(rate(ES + "disk_reads_total", "disk"), "{{disk}}")], unit="iops",
              stack=True, width=12),
        Panel("Read latency per disk (p50, p99)",
              [(quantile(0.5, ES + "disk_read_seconds", "disk"), "{{disk}} p50"),
               (quantile(0.99, ES + "disk_read_seconds", "disk"), "{{disk}} p99")], unit="s", width=12,
              description="One aligned read of one expert record."),
        Panel("Reads in flight and queued", [(f"sum({ES}reads_in_flight)", "in flight"),
                                             (f"sum({ES}reads_queued)", "queued"),
                                             (rate(ES + "reads_joined_total"), "joined / s (single-flight)")],
              width=12),
        Row("Errors and mirrors"),
        Panel("Read errors / s per disk", [(rate(ES + "disk_read_errors_total", "disk"), "{{disk}}")], unit="ops"),
        Panel("Checksum failures / s",
              [(rate(ES + "disk_checksum_failures_total", "disk"), "{{disk}}"),
               (rate(ES + "corrupt_records_total"), "no valid copy")], unit="ops",
              description="Records that failed verification; 'no valid copy' failed the request."),
        Panel("Reads served by another copy / s", [(rate(ES + "read_fallbacks_total"), "fallbacks")], unit="ops"),
        Panel("Mirror state", [(f"max by (disk) ({ES}disk_ok)", "{{disk}}")], kind="state-timeline", width=16,
              description="ok: the copy serves reads; degraded: read errors, re-probed later."),
        Panel("Placement weight", [(f"max by (disk) ({ES}disk_weight)", "{{disk}}")], kind="bargauge", width=8,
              description="Share of placements per copy: probed bandwidth (GB/s) or configured."),
    ])


def serving() -> dict[str, Any]:
    def lat(metric: str) -> list[tuple[str, str]]:
        return [(quantile(q, metric), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]

    return dashboard("moetier-serving", "moetier · Serving", "Requests and tokens through the gateway, the "
                     "router's queue and the dense workers' steps.", [
        Panel("Generated tokens / s", [(rate(GW + "generation_tokens_total"), "generated"),
                                       (rate(GW + "prompt_tokens_total"), "prompt")], unit="short", width=12),
        Panel("Requests", [(f"sum({GW}running_requests)", "running (gateway)"),
                           (f"sum({RT}queue_depth)", "waiting (router queue)"),
                           (f"sum({DW}running_requests)", "running (dense workers)"),
                           (f"sum({DW}waiting_requests)", "waiting (dense workers)")], width=12),
        Panel("Time to first token", lat(GW + "time_to_first_token_seconds"), unit="s"),
        Panel("Inter-token latency", lat(GW + "inter_token_latency_seconds"), unit="s"),
        Panel("End-to-end request latency", lat(GW + "e2e_request_latency_seconds"), unit="s"),
        Panel("Queue time", lat(GW + "queue_time_seconds"), unit="s",
              description="Router and worker queues before the first step."),
        Panel("Finished requests / s by reason", [(rate(GW + "finished_requests_total", "finish_reason"),
                                                   "{{finish_reason}}")], unit="reqps", stack=True),
        Panel("HTTP responses / s by status", [(rate(GW + "http_requests_total", "status"), "{{status}}")],
              unit="reqps", stack=True),
        Row("Dense worker steps"),
        Panel("Batch size", [(ratio(rate(DW + "batch_rows_sum"), rate(DW + "batch_rows_count")), "mean rows"),
                             (quantile(0.9, DW + "batch_rows"), "p90 rows"),
                             (ratio(rate(DW + "batch_sequences_sum"), rate(DW + "batch_sequences_count")),
                              "mean sequences")], width=8,
              description="Rows (decode tokens and prefill chunk tokens) and sequences per dense-worker step."),
        Panel("Step time breakdown (mean per step)",
              [(ratio(rate(DW + "step_phase_seconds_sum", "phase"), rate(DW + "step_phase_seconds_count", "phase")),
                "{{phase}}")], unit="s", stack=True, width=16,
              description="Where a step's time goes: attention, gates, waiting on expert stores, sampling, "
                          "other (embedding, norms, dense MLPs, shared experts, lm_head)."),
        Panel("Steps / s", [(rate(DW + "steps_total"), "steps")], unit="ops", width=8),
        Panel("Prefix cache", [(ratio(rate(DW + "prefix_cache_hit_tokens_total"),
                                      rate(DW + "prefix_cache_query_tokens_total")), "prompt tokens from the cache")],
              unit="percentunit", min=0, max=1, width=8,
              description="Share of prompt tokens served from the dense workers' prefix cache instead of prefilled."),
        Panel("KV cache", [(f"sum({DW}kv_cache_bytes)", "live sequences"),
                           (f"sum by (tier) ({DW}prefix_cache_bytes)", "prefix cache ({{tier}})")],
              unit="bytes", width=8),
        Panel("Router requests / s by outcome", [(rate(RT + "requests_total", "outcome"), "{{outcome}}")],
              unit="reqps", stack=True, width=8),
        Panel("Router queue time", lat(RT + "queue_time_seconds"), unit="s", width=8),
        Panel("Experts placed per expert store", [(f"sum by (store) ({RT}placed_experts)", "{{store}}"),
                                                  (f"max({RT}unowned_experts)", "no live owner")], width=8,
              description="Experts the router's placement map sends to each expert store first (its share of "
                          "what it owns, weighted by read bandwidth), and experts no live store owns (requests "
                          "needing them fail)."),
        Row("Speculative decoding (MTP drafts)"),
        Panel("Draft acceptance by position",
              [(ratio(rate(DW + "spec_accepted_tokens_total", "position"),
                      rate(DW + "spec_drafted_tokens_total", "position")), "position {{position}}"),
               (ratio(rate(DW + "spec_accepted_tokens_total"), rate(DW + "spec_drafted_tokens_total")), "all")],
              unit="percentunit", min=0, max=1, width=8,
              description="Share of the MTP head's drafts the main model accepted, per draft position (a draft "
                          "is verified only when the ones before it were accepted)."),
        Panel("Tokens per forward", [(ratio(rate(DW + "spec_emitted_tokens_total"), rate(DW + "spec_forwards_total")),
                                      "tokens per decode forward")], min=1, width=8,
              description="Tokens a generating sequence gets per step: 1 without drafts, up to k + 1 with k."),
        Panel("Steps by drafting choice", [(rate(DW + "spec_steps_total", "mode, reason"), "{{mode}} {{reason}}")],
              unit="ops", stack=True, width=8,
              description="What the cost-model controller chose for the next step: drafting on, or off and why "
                          "(cost: the widened expert union does not pay; measuring; disabled; no_mtp)."),
    ])


DASHBOARDS = {"expert-cache.json": expert_cache, "disk.json": disk, "serving.json": serving}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    rendered = render()
    if "--check" in argv:
        stale = [n for n, text in rendered.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        for n in stale:
            print(f"{OUT / n} is stale: run python deploy/grafana/generate.py", file=sys.stderr)
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
