"""Synthetic expert record files, for tests and `moetier bench io` without a model.

Files follow the container's layout (docs/internals.md): experts/layer-NNN.bin
holding the records of one layer in expert order from offset 0, each record
4 KiB-aligned, and experts/index.json in the documented format (without a record
layout: `"layout": null`), so `ExpertIndex.load` reads and validates them like a container's.

`f32_parser(hidden, inter)` gives records a real meaning for compute tests: a
record holds gate [I, D], up [I, D] and down [D, I] as float32, one after the other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

from moetier.weights.format import CHECKSUM, FORMAT_VERSION, RECORD_ALIGN
from moetier.weights.index import ExpertIndex, ExpertKey, RecordLocation, index_identity
from moetier.weights.quant import ExpertWeights, QTensor

Filler = Callable[[ExpertKey, np.random.Generator], bytes]


def _pad(n: int) -> int:
    return -(-n // RECORD_ALIGN) * RECORD_ALIGN


def write_records(
    model_dir: Path | str,
    layers: Sequence[int],
    n_experts: int,
    record_bytes: int | Callable[[ExpertKey], int],
    *,
    seed: int = 0,
    fill: Filler | None = None,
    parse: Callable[[npt.NDArray[np.uint8]], object] | None = None,
) -> ExpertIndex:
    """Write layer files of `n_experts` records of `record_bytes` (rounded up to 4 KiB; a function
    of the key for mixed sizes) under model_dir/experts; `fill(key, rng)` gives a record's
    content (default random bytes)."""
    experts = Path(model_dir) / "experts"
    experts.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = [f"layer-{layer:03d}.bin" for layer in layers]
    records: dict[ExpertKey, RecordLocation] = {}
    rows = []
    for fi, (layer, name) in enumerate(zip(layers, files, strict=True)):
        offset = 0
        with open(experts / name, "wb") as f:
            for e in range(n_experts):
                length = _pad(record_bytes((layer, e)) if callable(record_bytes) else record_bytes)
                body = fill((layer, e), rng) if fill is not None else rng.bytes(length)
                data = body + bytes(length - len(body))
                assert len(data) == length, "a record's content is larger than record_bytes"
                checksum = xxhash.xxh3_64_intdigest(data)
                records[(layer, e)] = RecordLocation(name, offset, length, checksum)
                rows.append([layer, e, fi, offset, length, f"{checksum:016x}"])
                f.write(data)
                offset += length
    identity = index_identity(None, files, rows)
    doc = {"format_version": FORMAT_VERSION, "checksum": CHECKSUM, "layout": None, "files": files,
           "moe_layers": list(layers), "n_experts": n_experts, "records": rows, "identity": identity}
    (experts / "index.json").write_text(json.dumps(doc))
    return ExpertIndex.from_records(experts, records, identity, parse)


def f32_record(hidden: int, inter: int, rng: np.random.Generator) -> bytes:
    """gate [I, D], up [I, D], down [D, I] float32, scaled like a trained FFN."""
    w = rng.standard_normal(3 * inter * hidden).astype(np.float32) / np.float32(np.sqrt(hidden))
    return w.tobytes()


def f32_parser(hidden: int, inter: int) -> Callable[[npt.NDArray[np.uint8]], ExpertWeights]:
    n = inter * hidden

    def parse(buf: npt.NDArray[np.uint8]) -> ExpertWeights:
        w = buf[: 3 * n * 4].view(np.float32)  # zero-copy views into the record
        return ExpertWeights(
            gate=QTensor("f32", (inter, hidden), w[:n].reshape(inter, hidden)),
            up=QTensor("f32", (inter, hidden), w[n:2 * n].reshape(inter, hidden)),
            down=QTensor("f32", (hidden, inter), w[2 * n:].reshape(hidden, inter)),
        )

    return parse
