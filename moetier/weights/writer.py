"""Container writer. It enforces its own write order:

  1. dense files (`dense_file`) and expert records (`write_record`), in any order -- a
     record's place is fixed by its (layer, expert), so records may arrive in any order and
     the files come out byte-identical;
  2. `finish`: experts/index.json, then the copied source files (config.json, tokenizer...),
     then moetier.json, written atomically and last. Its presence marks a complete container.

Nothing can be written after `finish`, and `finish` refuses unless every dense tensor of
the model and every (layer, expert) record has been written exactly once.
A converter that resumes an interrupted run re-declares what its journal says is already
on disk with `note_dense_file` / `note_record`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moetier.errors import FormatError
from moetier.model.config import ModelArgs
from moetier.weights.dense import DenseFileWriter, DenseSpec
from moetier.weights.format import (
    CHECKSUM,
    DENSE_DIR,
    EXPERTS_DIR,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    atomic_write,
    created_by,
    dense_file_name,
    expert_file_name,
    fsync_dir,
    json_bytes,
    xxh3_file,
    xxh3_hex,
)
from moetier.weights.index import index_identity
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import ExpertWeights, QDType
from moetier.weights.schema import DENSE_ALLOWED, EXPERTS_ALLOWED, dense_shapes, storage_dtype


def planned_dense(args: ModelArgs, dense: QDType, group_size: int) -> dict[str, DenseSpec]:
    """Every dense tensor of the model with the dtype it is stored in."""
    out = {}
    for name, shape in dense_shapes(args).items():
        dt = storage_dtype(name, shape, dense)
        out[name] = DenseSpec(name, dt, shape, group_size if dt in ("int8", "int4") else 0)
    return out


class ContainerWriter:
    def __init__(self, out: Path, args: ModelArgs, experts: QDType = "int4", dense: QDType = "int8",
                 group_size: int = 64) -> None:
        if experts not in EXPERTS_ALLOWED:
            raise FormatError(f"expert dtype {experts!r} not allowed; choose one of {', '.join(EXPERTS_ALLOWED)}")
        if dense not in DENSE_ALLOWED:
            raise FormatError(f"dense dtype {dense!r} not allowed; choose one of {', '.join(DENSE_ALLOWED)}")
        if group_size <= 0 or group_size % 2:
            raise FormatError(f"group size {group_size} must be a positive even number")
        if (out / MANIFEST).exists():
            raise FormatError(f"{out} already holds a complete container ({MANIFEST} exists)")
        self.out = out
        self.args = args
        self.quantization = {"experts": experts, "dense": dense, "group_size": group_size}
        self.layout = RecordLayout.build(args.moe_intermediate_size, args.hidden_size, experts, group_size)
        self.dense_specs = planned_dense(args, dense, group_size)
        self.moe_layers = args.moe_layer_ids
        self._records: dict[tuple[int, int], str] = {}
        self._dense_where: dict[str, str] = {}
        self._dense_files: set[str] = set()
        self._fds: dict[int, int] = {}
        self._finished = False
        (out / DENSE_DIR).mkdir(parents=True, exist_ok=True)
        (out / EXPERTS_DIR).mkdir(parents=True, exist_ok=True)

    # ---- 1. dense files and expert records ------------------------------------------------
    def dense_file(self, k: int, names: Iterable[str]) -> DenseFileWriter:
        """Open dense/model-{k:05d}.safetensors for the named tensors; the caller adds and closes it."""
        self._check_open()
        rel = dense_file_name(k)
        names = list(names)
        self._claim_dense(rel, names)
        return DenseFileWriter(self.out / rel, [self.dense_specs[n] for n in names])

    def note_dense_file(self, k: int, names: Iterable[str]) -> None:
        """A dense file already on disk from an earlier run (resume)."""
        self._check_open()
        rel = dense_file_name(k)
        if not (self.out / rel).is_file():
            raise FormatError(f"{rel}: recorded as written but missing")
        self._claim_dense(rel, list(names))

    def _claim_dense(self, rel: str, names: list[str]) -> None:
        if rel in self._dense_files:
            raise FormatError(f"{rel}: written twice")
        for n in names:
            if n not in self.dense_specs:
                raise FormatError(f"{rel}: {n!r} is not a dense tensor of this {self.args.arch} model")
            if n in self._dense_where:
                raise FormatError(f"{rel}: tensor {n!r} already written to {self._dense_where[n]}")
            self._dense_where[n] = rel
        self._dense_files.add(rel)

    def record_offset(self, expert: int) -> int:
        return expert * self.layout.record_bytes

    def _fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            if layer not in self.moe_layers:
                raise FormatError(f"layer {layer} is not a MoE layer of this model")
            path = self.out / EXPERTS_DIR / expert_file_name(layer)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            size = self.args.n_routed_experts * self.layout.record_bytes
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._fds[layer] = fd
        return fd

    def expert_file(self, layer: int) -> Path:
        """Create and size a layer's expert file; returns its path (for writers in other processes,
        which then declare their records with `note_record`)."""
        self._fd(layer)
        return self.out / EXPERTS_DIR / expert_file_name(layer)

    def write_record(self, layer: int, expert: int, ew: ExpertWeights) -> str:
        """Pack and write one expert's record at its fixed place; returns its checksum."""
        return self.write_record_bytes(layer, expert, self.layout.pack(ew))

    def write_record_bytes(self, layer: int, expert: int, record: bytes | bytearray) -> str:
        self._check_open()
        if not 0 <= expert < self.args.n_routed_experts:
            raise FormatError(f"expert {expert} out of range for {self.args.n_routed_experts} experts")
        if len(record) != self.layout.record_bytes:
            raise FormatError(f"record for layer {layer} expert {expert} is {len(record)} bytes, "
                              f"layout says {self.layout.record_bytes}")
        fd = self._fd(layer)
        os.pwrite(fd, record, self.record_offset(expert))
        ck = xxh3_hex(record)
        self._records[(layer, expert)] = ck
        return ck

    def note_record(self, layer: int, expert: int, checksum: str) -> None:
        """A record already on disk from an earlier run (resume)."""
        self._check_open()
        self._fd(layer)
        self._records[(layer, expert)] = checksum

    def sync(self) -> None:
        """fsync the expert files (a converter calls this before journaling progress)."""
        for fd in self._fds.values():
            os.fsync(fd)

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("container writer already finished")

    # ---- 2. index, copies, manifest ----------------------------------------------------------
    def finish(self, source: Mapping[str, Any], copies: Mapping[str, bytes | Path],
               quant_error: Mapping[str, Any] | None = None) -> Path:
        """Write index.json, the copied files and, last, moetier.json. Returns the manifest path."""
        self._check_open()
        missing_dense = [n for n in self.dense_specs if n not in self._dense_where]
        if missing_dense:
            raise FormatError(f"missing dense tensors: {', '.join(missing_dense[:5])}"
                              + (f" (+{len(missing_dense) - 5} more)" if len(missing_dense) > 5 else ""))
        e_count = self.args.n_routed_experts
        missing = [(li, e) for li in self.moe_layers for e in range(e_count) if (li, e) not in self._records]
        if missing:
            li, e = missing[0]
            raise FormatError(f"missing expert records: layer {li} expert {e}"
                              + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        self.sync()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._finished = True

        files = [expert_file_name(li) for li in self.moe_layers]
        rb = self.layout.record_bytes
        records = [[li, e, fi, e * rb, rb, self._records[(li, e)]]
                   for fi, li in enumerate(self.moe_layers) for e in range(e_count)]
        layout = self.layout.to_dict()
        index = {
            "format_version": FORMAT_VERSION,
            "checksum": CHECKSUM,
            "layout": layout,
            "files": files,
            "moe_layers": list(self.moe_layers),
            "n_experts": e_count,
            "records": records,
            "identity": index_identity(layout, files, records),
        }
        atomic_write(self.out / INDEX, json_bytes(index))
        for name, content in sorted(copies.items()):
            dst = self.out / name
            if isinstance(content, Path):
                tmp = dst.with_name(dst.name + ".tmp")
                shutil.copyfile(content, tmp)
                os.replace(tmp, dst)
            else:
                atomic_write(dst, content)

        rels = sorted(self._dense_files) + [INDEX] + [f"{EXPERTS_DIR}/{f}" for f in files] + sorted(copies)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": self.args.to_dict(),
            "quantization": dict(self.quantization),
            "source": dict(source),
            "files": {r: {"size": (self.out / r).stat().st_size, CHECKSUM: xxh3_file(self.out / r)} for r in rels},
            "expert_bytes": len(records) * rb,
            "created_by": created_by(),
        }
        if quant_error is not None:
            manifest["quant_error"] = dict(quant_error)
        fsync_dir(self.out / DENSE_DIR)
        fsync_dir(self.out / EXPERTS_DIR)
        atomic_write(self.out / MANIFEST, json_bytes(manifest))
        return self.out / MANIFEST

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
