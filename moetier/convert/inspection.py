"""`moetier inspect`: what a container holds and what its quantization cost.

The error figures are relative RMS per tensor class against the float source, with int4
per-group and int4 per-row on the same tensors beside them. For a synth container the
source tensors are regenerated from the preset and seed (a sample of layers and experts);
for a converted checkpoint they were measured during conversion and stored in the manifest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetier.convert import synth
from moetier.convert.qerror import Stats, experts_sample, measure, summary
from moetier.model.kv_cache import ROLLBACK
from moetier.weights.container import Container
from moetier.weights.schema import EXPERT_PARTS, expert_shapes, tensor_class


def _sample_layers(layers: list[int], n: int = 4) -> list[int]:
    if len(layers) <= n:
        return list(layers)
    idx = np.linspace(0, len(layers) - 1, n).round().astype(int)
    return sorted({layers[i] for i in idx})


def synth_errors(c: Container) -> dict[str, Any]:
    """Regenerate a sample of a synth container's source tensors and measure the stored ones."""
    src = c.source
    seed = int(src["seed"])
    args, g = c.args, int(c.quantization["group_size"])
    stats: Stats = {}
    all_layers = list(range(args.num_layers))
    layers = set(_sample_layers(all_layers))
    for name in c.dense_names():
        spec = c.dense_spec(name)
        if tensor_class(name, spec.shape) != "dense":
            continue
        if name.startswith("layers.") and int(name.split(".")[1]) not in layers:
            continue
        x = synth.dense_tensor(name, spec.shape, seed, args.hidden_size)
        measure(stats, "dense", x, c.dense(name), g)
    shapes = expert_shapes(args)
    for li in _sample_layers(args.moe_layer_ids):
        for e in experts_sample(args.n_routed_experts):
            ew = c.read_expert(li, e)
            for part, q in zip(EXPERT_PARTS, (ew.gate, ew.up, ew.down), strict=True):
                measure(stats, "experts", synth.expert_tensor(li, e, part, shapes[part], seed), q, g)
    return summary(stats, c.quantization)


def synth_mtp_error(c: Container) -> dict[str, Any]:
    """The MTP head's error against its regenerated source (dense tensors, a sample of experts)."""
    assert c.mtp is not None
    seed, args, g = int(c.source["seed"]), c.args, c.mtp.group_size
    stats: Stats = {}
    for name, spec in c.mtp.specs.items():
        if tensor_class(name, spec.shape) == "dense":
            measure(stats, "mtp", synth.dense_tensor(name, spec.shape, seed, args.hidden_size), c.mtp.dense(name), g)
    shapes = expert_shapes(args)
    for li in c.mtp.expert_layers:
        for e in experts_sample(args.n_routed_experts):
            ew = c.read_expert(li, e)
            for part, q in zip(EXPERT_PARTS, (ew.gate, ew.up, ew.down), strict=True):
                measure(stats, "mtp", synth.expert_tensor(li, e, part, shapes[part], seed), q, g)
    if not stats:
        return {}
    return summary(stats, {"mtp": c.mtp.dtype, "group_size": g})["mtp"]


def mtp_report(c: Container, regenerate: bool) -> dict[str, Any] | None:
    """The MTP head: presence, precision, sizes and quantization error (None: the container has none)."""
    if c.mtp is None:
        return None
    m = c.mtp
    error = synth_mtp_error(c) if regenerate else m.quant_error
    return {"layers": m.layers, "dtype": m.dtype, "group_size": m.group_size, "dense_bytes": m.dense_bytes,
            "expert_bytes": m.expert_bytes, "record_bytes": m.layout.record_bytes, "quant_error": error}


def inspect_container(path: str, verify: bool = False) -> dict[str, Any]:
    with Container.open(path, verify=verify) as c:
        a = c.args
        by_class: dict[str, int] = {}
        for name in c.dense_names():
            spec = c.dense_spec(name)
            nbytes = sum(int(np.prod(s)) * (4 if t == "F32" else 2 if t in ("F16", "U16") else 1)
                         for _, t, s in spec.entries())
            cls = tensor_class(name, spec.shape)
            by_class[cls] = by_class.get(cls, 0) + nbytes
        by_class["experts"] = c.expert_bytes
        built_by = c.source.get("generator", 1)
        if c.source.get("kind") == "synth" and built_by != synth.GENERATOR_VERSION:
            errors, err_source = {}, (f"not available: built by synth generator {built_by}, this moetier "
                                      f"regenerates with {synth.GENERATOR_VERSION}")
        elif c.source.get("kind") == "synth":
            errors, err_source = synth_errors(c), "regenerated from preset and seed (sampled layers and experts)"
        elif "quant_error" in c.manifest:
            errors, err_source = c.manifest["quant_error"], "measured during conversion (sampled experts)"
        else:
            errors, err_source = {}, "not recorded"
        return {
            "path": str(path),
            "arch": a.arch,
            "attention": a.attention,
            "hidden_size": a.hidden_size,
            "layers": a.num_layers,
            "moe_layers": len(a.moe_layer_ids),
            "experts": a.n_routed_experts,
            "top_k": a.num_experts_per_tok,
            "moe_intermediate_size": a.moe_intermediate_size,
            "vocab_size": a.vocab_size,
            "linear_layers": sum(a.linear_layers),
            "kv_bytes_per_token": 4 * a.kv_floats_per_token,
            "state_bytes": 4 * a.state_floats,
            "quantization": dict(c.quantization),
            "record_bytes": c.layout.record_bytes,
            "record_used_bytes": c.layout.used_bytes,
            "expert_bytes": c.expert_bytes,
            "bytes_by_class": by_class,
            "total_bytes": sum(int(f["size"]) for f in c.files.values()),
            "source": {k: v for k, v in c.source.items() if k != "files"},
            "index_identity": c.index.identity,
            "verified": verify,
            "quant_error": errors,
            "quant_error_source": err_source,
            "mtp": mtp_report(c, regenerate=c.source.get("kind") == "synth"
                              and built_by == synth.GENERATOR_VERSION),
            "mechanisms": mechanisms(c),
        }


def mechanisms(c: Container) -> list[str]:
    """What the model does beyond plain attention and SwiGLU experts (gpt-oss's sinks, sliding
    windows, router, biased clamped experts), one phrase each."""
    a, out = c.args, []
    if a.attn_sinks:
        out.append("attention sinks (a learned logit per head)")
    if a.sliding_layers:
        n = sum(a.sliding_layers)
        out.append(f"sliding window {a.sliding_window} in {n} of {a.num_layers} layers "
                   f"(their KV cache keeps {a.sliding_window} + {ROLLBACK} positions)")
    if a.scoring_func == "topk_softmax":
        out.append("router: top-k of the biased logits, then their softmax")
    if a.expert_bias:
        act = c.layout.act
        out.append(f"experts with biases, {act.kind} (alpha {act.alpha}, limit {act.limit})")
    if c.quantization["experts"] == "mxfp4":
        out.append("experts mxfp4: e2m1 with one e8m0 scale per 32 (4.25 bits per weight)")
    return out


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_report(r: dict[str, Any]) -> str:
    q = r["quantization"]
    lines = [
        f"container      {r['path']}",
        f"architecture   {r['arch']} ({r['attention']}), hidden {r['hidden_size']}, vocab {r['vocab_size']}",
        f"layers         {r['layers']} ({r['moe_layers']} MoE), {r['experts']} experts top-{r['top_k']}, "
        f"expert intermediate {r['moe_intermediate_size']}",
        *([f"linear attn    {r['linear_layers']} Gated DeltaNet layers of {r['layers']}: a fixed state of "
           f"{r['state_bytes'] / 1024:,.1f} KiB per sequence, KV {r['kv_bytes_per_token']:,} bytes per token (full layers)"]
          if r.get("linear_layers") else []),
        f"quantization   experts {q['experts']}, dense {q['dense']}, group size {q['group_size']}",
        *(f"mechanism      {m}" for m in r.get("mechanisms", [])),
        f"expert record  {r['record_bytes']:,} bytes ({r['record_used_bytes']:,} used), "
        f"{_mb(r['expert_bytes'])} of experts",
        "bytes by class " + ", ".join(f"{k} {_mb(v)}" for k, v in sorted(r["bytes_by_class"].items())),
        f"total          {_mb(r['total_bytes'])}",
        "source         " + ", ".join(f"{k}={v}" for k, v in r["source"].items() if k not in ("identity", "skipped")),
        *(f"skipped        {why}: {e['tensors']} source tensors ({_mb(e['bytes'])}), not part of the served "
          "text model" for why, e in r["source"].get("skipped", {}).items()),
        f"index identity {r['index_identity']}" + ("  (all checksums verified)" if r["verified"] else ""),
        "",
        f"quantization error, relative RMS vs source ({r['quant_error_source']}):",
    ]
    g = q["group_size"]
    head = f"  {'class':<8} {'stored as':<10} {'tensors':>7} {'stored':>10} {'int4 g' + str(g):>10} {'int4 row':>10}"
    lines.append(head)
    for cls, e in r["quant_error"].items():
        lines.append(f"  {cls:<8} {e['dtype']:<10} {e['tensors']:>7} {e['rel_rms']:>10.5f} "
                     f"{e[f'int4_g{g}_rel_rms']:>10.5f} {e['int4_per_row_rel_rms']:>10.5f}")
    m = r.get("mtp")
    if m is None:
        lines.append("MTP head       none (no speculative decoding)")
    else:
        err = m["quant_error"]
        if err:
            g4 = err[f"int4_g{err['group_size']}_rel_rms"]
            rel = (f"relative RMS {err['rel_rms']:.5f} over {err['tensors']} tensors "
                   f"(int4 g{err['group_size']} would be {g4:.5f})")
        else:
            rel = "error not recorded"
        lines.append(f"MTP head       {m['layers']} layer(s), {m['dtype']} g{m['group_size']}: "
                     f"{_mb(m['dense_bytes'])} dense + {_mb(m['expert_bytes'])} experts; {rel}")
    return "\n".join(lines)
