"""Container reader: `Container.open(path)` validates loudly, then serves dense tensors as
zero-copy memmap views and expert records by plain reads (the fast O_DIRECT engine lives
in moetier/store and uses `container.index` directly).

Every error names the file, and where it applies the tensor, layer, expert and offset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from moetier.errors import DataCorruption, FormatError
from moetier.model.config import ModelArgs
from moetier.weights.dense import DenseFile, DenseSpec
from moetier.weights.format import (
    CHECKSUM,
    DENSE_DIR,
    EXPERTS_DIR,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    INDEX_KEYS,
    MANIFEST,
    MANIFEST_KEYS,
    MANIFEST_OPTIONAL,
    QUANT_KEYS,
    RECORD_ALIGN,
    expert_file_name,
    xxh3_file,
    xxh3_hex,
)
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import ExpertWeights, QTensor
from moetier.weights.schema import DENSE_ALLOWED, EXPERTS_ALLOWED
from moetier.weights.writer import index_identity, planned_dense


@dataclass(frozen=True)
class ExpertLocation:
    layer: int
    expert: int
    file: str  # relative to the container, e.g. "experts/layer-001.bin"
    path: Path
    offset: int
    length: int
    checksum: str  # xxh3_64 hex of the `length` bytes at `offset`


def _keys(obj: Any, required: set[str], optional: set[str], label: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise FormatError(f"{label}: expected a JSON object")
    missing = sorted(required - set(obj))
    if missing:
        raise FormatError(f"{label}: missing field(s) {', '.join(missing)}")
    extra = sorted(set(obj) - required - optional)
    if extra:
        raise FormatError(f"{label}: unknown field(s) {', '.join(extra)}")
    return obj


def _load_json(path: Path, label: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise FormatError(f"{label}: missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{label}: not valid JSON ({e})") from e


class ExpertIndex:
    """experts/index.json: the (layer, expert) -> location map and the shared record layout."""

    def __init__(self, root: Path, obj: Any, args: ModelArgs, quant: dict[str, Any],
                 sizes: dict[str, int]) -> None:
        label = INDEX
        d = _keys(obj, INDEX_KEYS, set(), label)
        if d["format_version"] != FORMAT_VERSION:
            raise FormatError(f"{label}: format_version {d['format_version']!r}, this moetier reads {FORMAT_VERSION}")
        if d["checksum"] != CHECKSUM:
            raise FormatError(f"{label}: checksum {d['checksum']!r} unsupported (expected {CHECKSUM})")
        self.layout = RecordLayout.from_dict(d["layout"])
        want = RecordLayout.build(args.moe_intermediate_size, args.hidden_size, quant["experts"], quant["group_size"])
        if self.layout != want:
            raise FormatError(f"{label}: record layout does not match the model shape and quantization "
                              f"in {MANIFEST}")
        self.moe_layers: list[int] = list(d["moe_layers"])
        self.n_experts = int(d["n_experts"])
        if self.moe_layers != args.moe_layer_ids or self.n_experts != args.n_routed_experts:
            raise FormatError(f"{label}: moe_layers/n_experts disagree with the model in {MANIFEST}")
        self.files: list[str] = list(d["files"])
        if self.files != [expert_file_name(li) for li in self.moe_layers]:
            raise FormatError(f"{label}: files {self.files[:3]}... are not one per MoE layer")
        self.identity: str = d["identity"]
        if index_identity(d["layout"], d["files"], d["records"]) != self.identity:
            raise FormatError(f"{label}: identity does not match its layout, files and records")
        rb = self.layout.record_bytes
        self._loc: dict[tuple[int, int], ExpertLocation] = {}
        for rec in d["records"]:
            try:
                layer, expert, fi, offset, length, ck = rec
                rel = f"{EXPERTS_DIR}/{self.files[fi]}"
            except (ValueError, TypeError, IndexError) as e:
                raise FormatError(f"{label}: malformed record {rec!r}") from e
            where = f"{label}: record layer {layer} expert {expert} ({rel} offset {offset})"
            if (layer, expert) in self._loc:
                raise FormatError(f"{where}: duplicate")
            if layer not in self.moe_layers or not 0 <= expert < self.n_experts:
                raise FormatError(f"{where}: no such MoE layer/expert")
            if self.moe_layers[fi] != layer:
                raise FormatError(f"{where}: stored in the file of layer {self.moe_layers[fi]}")
            if offset % RECORD_ALIGN or length != rb:
                raise FormatError(f"{where}: not {RECORD_ALIGN}-aligned or length {length} != {rb}")
            if offset + length > sizes.get(rel, -1):
                raise FormatError(f"{where}: ends at {offset + length} past the end of the "
                                  f"{sizes.get(rel, 0)}-byte file")
            self._loc[(layer, expert)] = ExpertLocation(layer, expert, rel, root / rel, offset, length, str(ck))
        n_want = len(self.moe_layers) * self.n_experts
        if len(self._loc) != n_want:
            raise FormatError(f"{label}: {len(self._loc)} records, the model has {n_want} routed experts")

    def location(self, layer: int, expert: int) -> ExpertLocation:
        try:
            return self._loc[(layer, expert)]
        except KeyError:
            raise FormatError(f"no expert record for layer {layer} expert {expert}") from None

    def __iter__(self) -> Iterator[ExpertLocation]:
        return iter(self._loc.values())

    def __len__(self) -> int:
        return len(self._loc)


class Container:
    """An opened, validated container directory."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        m = manifest
        try:
            self.args = ModelArgs.from_dict(m["model"])
        except (ValueError, TypeError) as e:
            raise FormatError(f"{MANIFEST}: model: {e}") from e
        q = _keys(m["quantization"], QUANT_KEYS, set(), f"{MANIFEST}: quantization")
        if q["experts"] not in EXPERTS_ALLOWED or q["dense"] not in DENSE_ALLOWED or not isinstance(
                q["group_size"], int) or q["group_size"] <= 0:
            raise FormatError(f"{MANIFEST}: unsupported quantization {q}")
        self.quantization: dict[str, Any] = q
        self.source: dict[str, Any] = m["source"]
        files = m["files"]
        if not isinstance(files, dict):
            raise FormatError(f"{MANIFEST}: files must be an object")
        self.files: dict[str, dict[str, Any]] = files
        sizes: dict[str, int] = {}
        for rel, ent in files.items():
            p = PurePosixPath(rel)
            if p.is_absolute() or ".." in p.parts or rel == MANIFEST:
                raise FormatError(f"{MANIFEST}: file path {rel!r} is outside the container")
            ent = _keys(ent, {"size", CHECKSUM}, set(), f"{MANIFEST}: files[{rel!r}]")
            try:
                size = (path / rel).stat().st_size
            except FileNotFoundError:
                raise FormatError(f"{rel}: listed in {MANIFEST} but missing") from None
            if size != ent["size"]:
                raise FormatError(f"{rel}: {size} bytes, {MANIFEST} says {ent['size']} (truncated or replaced?)")
            sizes[rel] = size
        if INDEX not in files:
            raise FormatError(f"{MANIFEST}: files does not list {INDEX}")
        self.index = ExpertIndex(path, _load_json(path / INDEX, INDEX), self.args, q, sizes)
        self.layout = self.index.layout
        self.expert_bytes = int(m["expert_bytes"])
        if self.expert_bytes != len(self.index) * self.layout.record_bytes:
            raise FormatError(f"{MANIFEST}: expert_bytes {self.expert_bytes} != records x record size")
        for rel in self.index.files:
            if f"{EXPERTS_DIR}/{rel}" not in files:
                raise FormatError(f"{MANIFEST}: files does not list {EXPERTS_DIR}/{rel}")
        self._open_dense(sorted(r for r in files if r.startswith(DENSE_DIR + "/") and r.endswith(".safetensors")))
        self._fds: dict[str, int] = {}

    def _open_dense(self, rels: list[str]) -> None:
        self._dense_files: list[DenseFile] = []
        self._where: dict[str, DenseFile] = {}
        for rel in rels:
            df = DenseFile(self.path / rel, rel)
            self._dense_files.append(df)
            for name in df.specs:
                if name in self._where:
                    raise FormatError(f"{rel}: tensor {name!r} also stored in {self._where[name].label}")
                self._where[name] = df
        want = planned_dense(self.args, self.quantization["dense"], self.quantization["group_size"])
        for name, spec in want.items():
            holder = self._where.get(name)
            if holder is None:
                raise FormatError(f"dense tensor {name!r} is missing from {DENSE_DIR}/")
            if holder.specs[name] != spec:
                got = holder.specs[name]
                raise FormatError(f"{holder.label}: tensor {name!r} is {got.dtype}{list(got.shape)} g={got.group_size}, "
                                  f"expected {spec.dtype}{list(spec.shape)} g={spec.group_size}")
        extra = sorted(set(self._where) - set(want))
        if extra:
            raise FormatError(f"{self._where[extra[0]].label}: tensor {extra[0]!r} is not part of this model")

    # ---- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = False) -> Container:
        root = Path(path)
        if not root.is_dir():
            raise FormatError(f"{root}: not a directory")
        if not (root / MANIFEST).is_file():
            raise FormatError(f"{root}: no {MANIFEST} (not a container, or an unfinished conversion)")
        m = _keys(_load_json(root / MANIFEST, MANIFEST), MANIFEST_KEYS, MANIFEST_OPTIONAL, MANIFEST)
        if m["format"] != FORMAT:
            raise FormatError(f"{MANIFEST}: format {m['format']!r} is not {FORMAT!r}")
        if m["format_version"] != FORMAT_VERSION:
            raise FormatError(f"{MANIFEST}: format_version {m['format_version']!r} unsupported "
                              f"(this moetier reads {FORMAT_VERSION})")
        c = cls(root, m)
        if verify:
            c.verify()
        return c

    # ---- dense tensors ---------------------------------------------------------------------------
    def dense_names(self) -> list[str]:
        return list(planned_dense(self.args, self.quantization["dense"], self.quantization["group_size"]))

    def dense_spec(self, name: str) -> DenseSpec:
        return self._df(name).specs[name]

    def dense(self, name: str) -> QTensor:
        """A dense tensor as a QTensor whose arrays are read-only views of the memmapped file."""
        return self._df(name).get(name)

    def resident_dense(self) -> dict[str, QTensor]:
        """Every dense tensor, read once into anonymous memory with no copy left in the page cache
        (DenseFile.read_resident): what a server holds for its lifetime."""
        out: dict[str, QTensor] = {}
        for df in self._dense_files:
            out.update(df.read_resident())
        return {name: out[name] for name in self.dense_names()}

    def _df(self, name: str) -> DenseFile:
        df = self._where.get(name)
        if df is None:
            raise FormatError(f"no dense tensor {name!r} in {self.path}")
        return df

    # ---- experts -----------------------------------------------------------------------------
    def read_expert_bytes(self, layer: int, expert: int, verify: bool = True) -> bytes:
        loc = self.index.location(layer, expert)
        fd = self._fds.get(loc.file)
        if fd is None:
            fd = self._fds[loc.file] = os.open(loc.path, os.O_RDONLY)
        buf = os.pread(fd, loc.length, loc.offset)
        if len(buf) != loc.length:
            raise DataCorruption(f"{loc.file}: short read for layer {layer} expert {expert} at offset "
                                 f"{loc.offset}: {len(buf)} of {loc.length} bytes")
        if verify:
            self._check(loc, buf)
        return buf

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> ExpertWeights:
        buf = np.frombuffer(self.read_expert_bytes(layer, expert, verify), dtype=np.uint8)
        return self.layout.parse(buf)

    @staticmethod
    def _check(loc: ExpertLocation, buf: bytes | memoryview) -> None:
        got = xxh3_hex(buf)
        if got != loc.checksum:
            raise DataCorruption(f"{loc.file}: checksum mismatch for layer {loc.layer} expert {loc.expert} "
                                 f"at offset {loc.offset} ({loc.length} bytes): expected {loc.checksum}, got {got}")

    def verify(self) -> None:
        """Recheck every expert record and every file against the index and the manifest."""
        for loc in self.index:
            self.read_expert_bytes(loc.layer, loc.expert, verify=True)
        for rel, ent in self.files.items():
            got = xxh3_file(self.path / rel)
            if got != ent[CHECKSUM]:
                raise DataCorruption(f"{rel}: checksum mismatch: {MANIFEST} says {ent[CHECKSUM]}, file has {got}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for df in self._dense_files:
            df.close()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
