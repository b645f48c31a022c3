"""Container writer. It enforces its own write order:

  1. dense files (`dense_file`) and expert records (`write_record`), in any order -- a
     record's place is fixed by its (layer, expert), so records may arrive in any order and
     the files come out byte-identical;
  2. `finish`: experts/index.json, then the copied source files (config.json, tokenizer...),
     then moetier.json, written atomically and last. Its presence marks a complete container.

A container with an MTP head (`mtp_layers` > 0) also gets mtp/model-*.safetensors
(`mtp_dense_file`) and mtp/experts/ (records of expert layers num_layers + k, in the MTP dtype,
with their own index): the same rules, checked by `finish` too.

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
    MTP_DIR,
    MTP_EXPERTS_DIR,
    MTP_INDEX,
    atomic_write,
    created_by,
    dense_file_name,
    expert_file_name,
    fsync_dir,
    json_bytes,
    mtp_dense_file_name,
    xxh3_file,
    xxh3_hex,
)
from moetier.weights.index import index_identity
from moetier.weights.layout import RecordLayout, model_layout
from moetier.weights.quant import ExpertWeights, QDType
from moetier.weights.schema import (
    DENSE_ALLOWED,
    EXPERTS_ALLOWED,
    MTP_ALLOWED,
    dense_shapes,
    mtp_shapes,
    storage_dtype,
)


def _specs(shapes: Mapping[str, tuple[int, ...]], dense: QDType, group_size: int) -> dict[str, DenseSpec]:
    out = {}
    for name, shape in shapes.items():
        dt = storage_dtype(name, shape, dense)
        out[name] = DenseSpec(name, dt, shape, group_size if dt in ("int8", "int4") else 0)
    return out


def planned_dense(args: ModelArgs, dense: QDType, group_size: int) -> dict[str, DenseSpec]:
    """Every dense tensor of the model with the dtype it is stored in."""
    return _specs(dense_shapes(args), dense, group_size)


def planned_mtp(args: ModelArgs, layers: int, dtype: QDType, group_size: int) -> dict[str, DenseSpec]:
    """Every dense tensor of an MTP head of `layers` layers, stored in `dtype` (norms f32)."""
    return _specs(mtp_shapes(args, layers), dtype, group_size)


def mtp_expert_layers(args: ModelArgs, layers: int) -> list[int]:
    """Expert layer ids of the MTP layers: num_layers + k."""
    return [args.num_layers + k for k in range(layers)]


class ContainerWriter:
    def __init__(self, out: Path, args: ModelArgs, experts: QDType = "int4", dense: QDType = "int8",
                 group_size: int = 64, *, mtp_layers: int = 0, mtp_dtype: QDType = "int8",
                 mtp_hidden_first: bool = False) -> None:
        if experts not in EXPERTS_ALLOWED:
            raise FormatError(f"expert dtype {experts!r} not allowed; choose one of {', '.join(EXPERTS_ALLOWED)}")
        if dense not in DENSE_ALLOWED:
            raise FormatError(f"dense dtype {dense!r} not allowed; choose one of {', '.join(DENSE_ALLOWED)}")
        if group_size <= 0 or group_size % 2:
            raise FormatError(f"group size {group_size} must be a positive even number")
        if mtp_layers and mtp_dtype not in MTP_ALLOWED:
            raise FormatError(f"MTP dtype {mtp_dtype!r} not allowed; choose one of {', '.join(MTP_ALLOWED)}")
        if mtp_layers and not any(args.moe_layers):
            raise FormatError("an MTP head needs a MoE model (its layers are MoE layers)")
        if (out / MANIFEST).exists():
            raise FormatError(f"{out} already holds a complete container ({MANIFEST} exists)")
        self.out = out
        self.args = args
        self.quantization = {"experts": experts, "dense": dense, "group_size": group_size}
        self.layout = model_layout(args, experts, group_size)
        self.dense_specs = planned_dense(args, dense, group_size)
        self.moe_layers = args.moe_layer_ids
        self.mtp = {"layers": mtp_layers, "dtype": mtp_dtype, "group_size": group_size,
                    "hidden_first": mtp_hidden_first} if mtp_layers else None
        self.mtp_specs = planned_mtp(args, mtp_layers, mtp_dtype, group_size) if mtp_layers else {}
        self.mtp_layers = mtp_expert_layers(args, mtp_layers)
        self.mtp_layout = (model_layout(args, mtp_dtype, group_size)
                           if mtp_layers else None)
        self._records: dict[tuple[int, int], str] = {}
        self._dense_where: dict[str, str] = {}
        self._dense_files: set[str] = set()
        self._fds: dict[int, int] = {}
        self._finished = False
        (out / DENSE_DIR).mkdir(parents=True, exist_ok=True)
        (out / EXPERTS_DIR).mkdir(parents=True, exist_ok=True)
        if mtp_layers:
            (out / MTP_EXPERTS_DIR).mkdir(parents=True, exist_ok=True)

    # ---- 1. dense files and expert records ------------------------------------------------
    def dense_file(self, k: int, names: Iterable[str]) -> DenseFileWriter:
        """Open dense/model-{k:05d}.safetensors for the named tensors; the caller adds and closes it."""
        return self._dense_file(dense_file_name(k), list(names), self.dense_specs)

    def mtp_dense_file(self, k: int, names: Iterable[str]) -> DenseFileWriter:
        """Open mtp/model-{k:05d}.safetensors for the named MTP tensors (`mtp.{k}.*`)."""
        return self._dense_file(mtp_dense_file_name(k), list(names), self.mtp_specs)

    def _dense_file(self, rel: str, names: list[str], specs: Mapping[str, DenseSpec]) -> DenseFileWriter:
        self._check_open()
        self._claim_dense(rel, names, specs)
        return DenseFileWriter(self.out / rel, [specs[n] for n in names])

    def note_dense_file(self, k: int, names: Iterable[str], mtp: bool = False) -> None:
        """A dense (or MTP dense) file already on disk from an earlier run (resume)."""
        self._check_open()
        rel = mtp_dense_file_name(k) if mtp else dense_file_name(k)
        if not (self.out / rel).is_file():
            raise FormatError(f"{rel}: recorded as written but missing")
        self._claim_dense(rel, list(names), self.mtp_specs if mtp else self.dense_specs)

    def _claim_dense(self, rel: str, names: list[str], specs: Mapping[str, DenseSpec]) -> None:
        if rel in self._dense_files:
            raise FormatError(f"{rel}: written twice")
        for n in names:
            if n not in specs:
                raise FormatError(f"{rel}: {n!r} is not a dense tensor of this {self.args.arch} model"
                                  + (" (or its MTP head)" if self.mtp else ""))
            if n in self._dense_where:
                raise FormatError(f"{rel}: tensor {n!r} already written to {self._dense_where[n]}")
            self._dense_where[n] = rel
        self._dense_files.add(rel)

    def record_offset(self, expert: int, layer: int | None = None) -> int:
        return expert * (self.layout if layer is None else self.layout_for(layer)).record_bytes

    def layout_for(self, layer: int) -> RecordLayout:
        """The record layout of an expert layer: the model's, or the MTP head's (layers past the last)."""
        if layer in self.mtp_layers:
            assert self.mtp_layout is not None
            return self.mtp_layout
        return self.layout

    def _path(self, layer: int) -> Path:
        if layer in self.mtp_layers:
            return self.out / MTP_EXPERTS_DIR / expert_file_name(layer)
        if layer not in self.moe_layers:
            raise FormatError(f"layer {layer} is not a MoE layer of this model (nor of its MTP head)")
        return self.out / EXPERTS_DIR / expert_file_name(layer)

    def _fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            path = self._path(layer)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            size = self.args.n_routed_experts * self.layout_for(layer).record_bytes
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._fds[layer] = fd
        return fd

    def expert_file(self, layer: int) -> Path:
        """Create and size a layer's expert file; returns its path (for writers in other processes,
        which then declare their records with `note_record`)."""
        self._fd(layer)
        return self._path(layer)

    def write_record(self, layer: int, expert: int, ew: ExpertWeights) -> str:
        """Pack and write one expert's record at its fixed place; returns its checksum."""
        return self.write_record_bytes(layer, expert, self.layout_for(layer).pack(ew))

    def write_record_bytes(self, layer: int, expert: int, record: bytes | bytearray) -> str:
        self._check_open()
        if not 0 <= expert < self.args.n_routed_experts:
            raise FormatError(f"expert {expert} out of range for {self.args.n_routed_experts} experts")
        rb = self.layout_for(layer).record_bytes
        if len(record) != rb:
            raise FormatError(f"record for layer {layer} expert {expert} is {len(record)} bytes, layout says {rb}")
        fd = self._fd(layer)
        os.pwrite(fd, record, expert * rb)
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
               quant_error: Mapping[str, Any] | None = None, mtp_quant_error: Mapping[str, Any] | None = None) -> Path:
        """Write the indexes, the copied files and, last, moetier.json. Returns the manifest path."""
        self._check_open()
        specs = {**self.dense_specs, **self.mtp_specs}
        missing_dense = [n for n in specs if n not in self._dense_where]
        if missing_dense:
            raise FormatError(f"missing dense tensors: {', '.join(missing_dense[:5])}"
                              + (f" (+{len(missing_dense) - 5} more)" if len(missing_dense) > 5 else ""))
        e_count = self.args.n_routed_experts
        missing = [(li, e) for li in self.moe_layers + self.mtp_layers for e in range(e_count)
                   if (li, e) not in self._records]
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
        index, n_records = self._index(self.moe_layers, self.layout)
        atomic_write(self.out / INDEX, json_bytes(index))
        rels = [*sorted(r for r in self._dense_files if r.startswith(DENSE_DIR + "/")), INDEX]
        rels += [f"{EXPERTS_DIR}/{f}" for f in files]
        if self.mtp is not None:
            assert self.mtp_layout is not None
            mtp_index, _ = self._index(self.mtp_layers, self.mtp_layout)
            atomic_write(self.out / MTP_INDEX, json_bytes(mtp_index))
            rels += [*sorted(r for r in self._dense_files if r.startswith(MTP_DIR + "/")), MTP_INDEX]
            rels += [f"{MTP_EXPERTS_DIR}/{expert_file_name(li)}" for li in self.mtp_layers]
        for name, content in sorted(copies.items()):
            dst = self.out / name
            if isinstance(content, Path):
                tmp = dst.with_name(dst.name + ".tmp")
                shutil.copyfile(content, tmp)
                os.replace(tmp, dst)
            else:
                atomic_write(dst, content)
        rels += sorted(copies)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": self.args.to_dict(),
            "quantization": dict(self.quantization),
            "source": dict(source),
            "files": {r: {"size": (self.out / r).stat().st_size, CHECKSUM: xxh3_file(self.out / r)} for r in rels},
            "expert_bytes": n_records * self.layout.record_bytes,
            "created_by": created_by(),
        }
        if quant_error is not None:
            manifest["quant_error"] = dict(quant_error)
        if self.mtp is not None:
            mtp: dict[str, Any] = dict(self.mtp)
            if mtp_quant_error is not None:
                mtp["quant_error"] = dict(mtp_quant_error)
            manifest["mtp"] = mtp
        fsync_dir(self.out / DENSE_DIR)
        fsync_dir(self.out / EXPERTS_DIR)
        if self.mtp is not None:
            fsync_dir(self.out / MTP_DIR)
            fsync_dir(self.out / MTP_EXPERTS_DIR)
        atomic_write(self.out / MANIFEST, json_bytes(manifest))
        return self.out / MANIFEST

    def _index(self, layers: list[int], layout: RecordLayout) -> tuple[dict[str, Any], int]:
        e_count = self.args.n_routed_experts
        files = [expert_file_name(li) for li in layers]
        rb = layout.record_bytes
        records = [[li, e, fi, e * rb, rb, self._records[(li, e)]]
                   for fi, li in enumerate(layers) for e in range(e_count)]
        lay = layout.to_dict()
        return {
            "format_version": FORMAT_VERSION,
            "checksum": CHECKSUM,
            "layout": lay,
            "files": files,
            "moe_layers": list(layers),
            "n_experts": e_count,
            "records": records,
            "identity": index_identity(lay, files, records),
        }, len(records)

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
