"""Figures of a block: min / median / max per system, ratios, the text check, the tables."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

# (key, label, getter over one trial); higher is better unless noted in the table header
METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "ttft_s": lambda t: _g(t, "decode", "ttft_s"),
    "ttft_repeat_s": lambda t: _g(t, "decode_repeat", "ttft_s"),
    "decode_tok_s": lambda t: _pool(_g(t, "decode", "decode_tok_s"), _g(t, "decode_repeat", "decode_tok_s")),
    "prefill_tok_s": lambda t: _g(t, "prefill", "prefill_tok_s"),
    "cores_busy": lambda t: _pool(_g(t, "decode", "cores_busy"), _g(t, "decode_repeat", "cores_busy")),
    "peak_memory_bytes": lambda t: t.get("peak_memory"),
    "peak_rss_bytes": lambda t: t.get("peak_rss"),
    "disk_read_per_request_bytes": lambda t: _pool(_g(t, "decode", "read_bytes"), _g(t, "decode_repeat", "read_bytes")),
    "baseline_rss_bytes": lambda t: sum(t["baseline_rss"].values()) if t.get("baseline_rss") else None,
    "start_s": lambda t: t.get("start_s"),
}


def _g(t: dict[str, Any], request: str, key: str) -> float | None:
    """A figure of one request of a trial (None where the trial failed before it)."""
    value = (t.get(request) or {}).get(key)
    return None if value is None else float(value)


def _pool(*xs: float | None) -> float | None:
    """Mean of a trial's two decode requests (the first cold after warm-up, the second repeated)."""
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}


def _median_by_process(trials: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Each process's median over the trials of the {process: bytes} under `key`."""
    services: dict[str, list[int]] = {}
    for t in trials:
        for name, b in (t.get(key) or {}).items():
            services.setdefault(name, []).append(b)
    return {k: statistics.median(v) for k, v in services.items()}


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: spread(get(t) for t in trials) for k, get in METRICS.items()}
    out["baseline_rss_by_process"] = _median_by_process(trials, "baseline_rss")
    out["peak_rss_by_process"] = _median_by_process(trials, "peak_rss_by_process")
    out["failed"] = [f"round {t['round'] + 1}: {t['error']}" for t in trials if t.get("error")]
    return out


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not b["median"]:
        return None
    return float(a["median"] / b["median"])


def text_check(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Did every system write the same greedy text (every round, both decode requests)?"""
    texts = {label: [x for t in trials for x in t.get("texts", [])] for label, trials in results.items()}
    texts = {label: v for label, v in texts.items() if v}
    distinct = {x for v in texts.values() for x in v}
    out: dict[str, Any] = {"same_text": len(distinct) == 1}
    if len(distinct) > 1:
        ref_label = next(iter(texts))
        ref = texts[ref_label][0]
        diffs = {}
        for label, v in texts.items():
            for x in v:
                if x != ref:
                    i = next((k for k, (p, q) in enumerate(zip(ref, x, strict=False)) if p != q), min(len(ref), len(x)))
                    diffs[label] = {"first_difference_at_char": i, "reference": ref[max(0, i - 20): i + 40],
                                    "this": x[max(0, i - 20): i + 40], "reference_system": ref_label}
                    break
        out["differences"] = diffs
    out["text"] = next(iter(distinct)) if len(distinct) == 1 else None
    return out


def _fmt_spread(s: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not s:
        return "-"
    lo, mid, hi = (s[k] / scale for k in ("min", "median", "max"))
    if abs(hi - lo) < 10 ** -digits:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _mb_each(by_process: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in by_process.items())


def table(block: dict[str, Any]) -> str:
    """The block as text: one row per system, then the ratios and the text check."""
    head = (f"{block['precision']} · {block['regime']}"
            + (f", capped at {block['cap_bytes'] / 1e9:.2f} GB" if block.get("cap_bytes") else "")
            + f" · {block['describe']}")
    lines = [head, f"  {'system':<44} {'TTFT s':>18} {'TTFT again s':>18} {'decode tok/s':>20} "
                   f"{'prefill tok/s':>20} {'cores':>11} {'peak GB':>14} {'disk GB/req':>14}"]
    for label, s in block["systems"].items():
        sm = s["summary"]
        lines.append(f"  {label:<44} {_fmt_spread(sm['ttft_s']):>18} {_fmt_spread(sm['ttft_repeat_s']):>18} "
                     f"{_fmt_spread(sm['decode_tok_s']):>20} {_fmt_spread(sm['prefill_tok_s'], digits=1):>20} "
                     f"{_fmt_spread(sm['cores_busy']):>11} "
                     f"{_fmt_spread(sm['peak_memory_bytes'] or sm['peak_rss_bytes'], 1e9):>14} "
                     f"{_fmt_spread(sm['disk_read_per_request_bytes'], 1e9, 3):>14}")
        for failure in sm.get("failed", []):
            lines.append(f"    FAILED {failure[:300]}")
        base = sm["baseline_rss_by_process"]
        if len(base) > 1 or label.startswith("moetier"):
            lines.append("      baseline RSS: " + _mb_each(base))
            if peak := sm.get("peak_rss_by_process"):
                lines.append("      peak RSS:     " + _mb_each(peak))
    for r in block["ratios"]:
        lines.append(f"  ratio {r['system']} / {r['against']}: decode {_r(r['decode'])}, prefill {_r(r['prefill'])}, "
                     f"TTFT {_r(r['ttft'])} (lower is better)")
    tc = block["text_check"]
    if tc["same_text"]:
        lines.append("  same greedy text from every system")
    else:
        lines.append("  TEXT DIFFERS (the systems did different work):")
        for label, d in tc.get("differences", {}).items():
            lines.append(f"    {label} vs {d['reference_system']} at char {d['first_difference_at_char']}: "
                         f"{d['this']!r} vs {d['reference']!r}")
    lines.extend(f"  note: {n}" for n in block.get("notes", []))
    return "\n".join(lines)


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
