"""Writes each overlay's resources.yaml: the requests and limits of the expert stores and dense
workers, and the size of each store's volume, derived from the model the overlay serves.

    python deploy/kubernetes/resources.py                 # rewrite overlays/*/resources.yaml
    python deploy/kubernetes/resources.py --check         # exit 1 when one differs
    python deploy/kubernetes/resources.py --model DIR --config moetier.yml   # print a patch for
                                                          # another container (docs/deploy.md)

What is derived (moetier.perf.ModelCosts, the overlay's moetier.yml):
- expert store memory: its RAM tier, `model.expert_cache` resolved against the model's expert
  bytes (never more than all of them), plus RUNTIME_BYTES;
- expert store volume: the model's files (expert and dense bytes) plus VOLUME_SPARE, for a full
  copy on every replica (a store holding a shard needs less: see docs/deploy.md);
- dense worker memory: the dense weights, plus the float32 KV cache of `inference.max_batch_size`
  sequences of `inference.max_seq_len` tokens (capped by the model's context), plus RUNTIME_BYTES.
Requests equal limits for memory (a store or worker that is evicted loses its cache). CPUs are
the overlay's choice (OVERLAYS below), not derived. tests/test_kubernetes.py checks the files
are what this writes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RUNTIME_BYTES = 1 << 30  # Python, numpy, numba, gRPC and the kernels' scratch of one service: an allowance
VOLUME_SPARE = 1 << 30  # usage history, tuned profile, a converter's temporary files
ROUND = 64 << 20  # memory in MiB multiples of 64; volumes in whole GiB


@dataclass(frozen=True)
class Overlay:
    name: str
    preset: str | None  # a model shape (moetier synth --list); None: the model `moetier up` serves
    store_cpu: str
    worker_cpu: str
    storage_class: str | None = None  # the stores' local NVMe class; None: the cluster's default


OVERLAYS = (
    Overlay("demo", None, store_cpu="1", worker_cpu="1"),
    Overlay("glm-5", "glm-5", store_cpu="8", worker_cpu="32", storage_class="local-nvme"),
)


@dataclass(frozen=True)
class Sizes:
    """What the manifests need to know of a model."""

    source: str  # what it was derived from, for the file's header
    expert_bytes: int
    dense_bytes: int
    kv_bytes_per_token: int
    context: int  # the model's max_position_embeddings


def sizes_of_container(path: Path, source: str | None = None) -> Sizes:
    from moetier.perf import ModelCosts
    from moetier.weights.container import Container

    with Container.open(path) as c:
        q = c.quantization
        costs = ModelCosts.of(c.args, "", q["experts"], q["dense"], q["group_size"])
        return Sizes(source or f"the container {path}", c.expert_bytes, costs.dense_bytes,
                     costs.kv_bytes_per_token, c.args.max_position_embeddings)


def sizes_of_preset(name: str) -> Sizes:
    from moetier.convert.synth import preset_args
    from moetier.perf import ModelCosts

    args = preset_args(name)
    costs = ModelCosts.of(args, name)  # the converter's defaults: int4 experts, int8 dense, groups of 64
    return Sizes(f"the {name} shape (moetier synth --preset {name}; int4 experts, int8 dense)",
                 costs.expert_bytes, costs.dense_bytes, costs.kv_bytes_per_token, args.max_position_embeddings)


def served_model_sizes() -> Sizes:
    """The model `moetier up` serves with no model named: the demo, built as up builds it."""
    from moetier.launch import ensure_model
    from moetier.settings import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        path = ensure_model(load_settings(environ={"MOETIER_DATA_DIR": tmp}), echo=lambda _: None)
        return sizes_of_container(path, "the model `moetier up` serves (launch.ensure_model)")


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


def memory(n: int) -> str:
    return f"{_up(n, ROUND) >> 20}Mi"


def storage(n: int) -> str:
    return f"{_up(n, 1 << 30) >> 30}Gi"


def derived(sizes: Sizes, config: Path) -> dict[str, int]:
    from moetier.settings import load_settings, resolve_budget

    s = load_settings(config, environ={})
    cache = min(resolve_budget(s.model.expert_cache, sizes.expert_bytes), sizes.expert_bytes)
    tokens = s.inference.max_batch_size * min(s.inference.max_seq_len, sizes.context)
    return {"store_memory": cache + RUNTIME_BYTES,
            "store_volume": sizes.expert_bytes + sizes.dense_bytes + VOLUME_SPARE,
            "worker_memory": sizes.dense_bytes + tokens * sizes.kv_bytes_per_token + RUNTIME_BYTES,
            "expert_cache": cache, "kv_tokens": tokens}


def patch(sizes: Sizes, config: Path, o: Overlay) -> str:
    d = derived(sizes, config)
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": storage(d["store_volume"])}}}
    if o.storage_class:
        claim["storageClassName"] = o.storage_class
    store = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "moetier-expert-store"},
             "spec": {"template": {"spec": {"containers": [{
                 "name": "expert-store",
                 "resources": {"requests": {"cpu": o.store_cpu, "memory": memory(d["store_memory"])},
                               "limits": {"memory": memory(d["store_memory"])}}}]}},
                      "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": claim}]}}
    worker = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "moetier-dense-worker"},
              "spec": {"template": {"spec": {"containers": [{
                  "name": "dense-worker",
                  "resources": {"requests": {"cpu": o.worker_cpu, "memory": memory(d["worker_memory"])},
                                "limits": {"memory": memory(d["worker_memory"])}}}]}}}}
    where = config.relative_to(HERE) if config.is_relative_to(HERE) else config
    head = (f"# Written by deploy/kubernetes/resources.py from {sizes.source} and {where}:\n"
            f"# experts {sizes.expert_bytes / 2**30:.2f} GiB, dense {sizes.dense_bytes / 2**30:.2f} GiB; expert cache "
            f"{d['expert_cache'] / 2**30:.2f} GiB; KV for {d['kv_tokens']} tokens at {sizes.kv_bytes_per_token} "
            "bytes each.\n# Do not edit: change the overlay's moetier.yml or resources.py and run it again.\n")
    return head + yaml.safe_dump_all([store, worker], sort_keys=False)


def config_of(o: Overlay) -> Path:
    own = HERE / "overlays" / o.name / "moetier.yml"
    return own if own.exists() else HERE / "base" / "moetier.yml"


def render(o: Overlay) -> str:
    sizes = served_model_sizes() if o.preset is None else sizes_of_preset(o.preset)
    return patch(sizes, config_of(o), o)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a file differs from what this writes")
    p.add_argument("--model", type=Path, help="print the patch for this container instead")
    p.add_argument("--config", type=Path, default=HERE / "base" / "moetier.yml", help="with --model: its moetier.yml")
    p.add_argument("--store-cpu", default="4")
    p.add_argument("--worker-cpu", default="16")
    p.add_argument("--storage-class")
    args = p.parse_args(argv)
    if args.model:
        o = Overlay("custom", None, args.store_cpu, args.worker_cpu, args.storage_class)
        print(patch(sizes_of_container(args.model), args.config.resolve(), o), end="")
        return 0
    stale = []
    for o in OVERLAYS:
        path = HERE / "overlays" / o.name / "resources.yaml"
        text = render(o)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print("out of date (run python deploy/kubernetes/resources.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
