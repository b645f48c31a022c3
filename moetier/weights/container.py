"""Container reader: `Container.open(path)` validates loudly, then serves dense tensors as
zero-copy memmap views and expert records by plain reads (the fast O_DIRECT engine lives
in moetier/store and uses `container.index`, the one `ExpertIndex`, directly).

Every error names the file, and where it applies the tensor, layer, expert and offset.
"""

from __future__ import annotations

import json
import os
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
    MANIFEST,
    MANIFEST_KEYS,
    MANIFEST_OPTIONAL,
    MTP_DIR,
    MTP_EXPERTS_DIR,
    MTP_INDEX,
    MTP_KEYS,
    MTP_OPTIONAL,
    QUANT_KEYS,
    expert_file_name,
    xxh3_file,
    xxh3_hex,
)
from moetier.weights.index import ExpertIndex
from moetier.weights.layout import RecordLayout, model_layout
from moetier.weights.quant import ExpertWeights, QDType, QTensor
from moetier.weights.schema import DENSE_ALLOWED, EXPERTS_ALLOWED, MTP_ALLOWED
from moetier.weights.writer import mtp_expert_layers, planned_dense, planned_mtp


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


def _int(value: Any, label: str) -> int:
    """A JSON integer (not a bool, float or string) or a FormatError naming the field."""
    if type(value) is not int:
        raise FormatError(f"{label}: expected an integer, got {value!r}"[:300])
    return value


def _load_json(path: Path, label: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise FormatError(f"{label}: missing") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep or too long
        raise FormatError(f"{label}: not valid JSON ({e})"[:300]) from e


def _is_expert_file(rel: str) -> bool:
    p = PurePosixPath(rel)
    return len(p.parts) == 2 and p.parts[0] == EXPERTS_DIR and p.suffix == ".bin"


def within(root: Path, path: Path) -> bool:
    """Whether `path`, its symlinks followed, stays inside `root` (a path from a file must not
    lead out of the directory it was read from)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False


def _container_index(root: Path, doc: Any, args: ModelArgs, quant: dict[str, Any], sizes: dict[str, int], *,
                     experts_dir: str = EXPERTS_DIR, label: str = INDEX, layers: list[int] | None = None,
                     dtype: QDType | None = None) -> ExpertIndex:
    """experts/index.json (or the MTP head's mtp/experts/index.json) read by the one index reader,
    then held to what the manifest says: the canonical layout of the model's shape and
    quantization (`dtype`: the MTP head's), its MoE layers (`layers`: the MTP head's expert
    layers) and experts, one file per MoE layer holding that layer's records."""
    in_experts = {rel[len(experts_dir) + 1:]: n for rel, n in sizes.items() if rel.startswith(experts_dir + "/")}
    index = ExpertIndex.from_doc(root / experts_dir, doc, in_experts, label)
    want = model_layout(args, dtype or quant["experts"], quant["group_size"])
    if index.layout != want:
        raise FormatError(f"{label}: record layout does not match the model shape and quantization in {MANIFEST}")
    want_layers = args.moe_layer_ids if layers is None else layers
    if list(index.layers) != want_layers or index.n_experts != args.n_routed_experts:
        raise FormatError(f"{label}: moe_layers/n_experts disagree with the model in {MANIFEST}")
    if list(doc["files"]) != [expert_file_name(li) for li in index.layers]:
        raise FormatError(f"{label}: files {list(doc['files'])[:3]}... are not one per MoE layer")
    for (layer, expert), loc in index:
        if loc.path != expert_file_name(layer):
            raise FormatError(f"{label}: record layer {layer} expert {expert} ({experts_dir}/{loc.path} offset "
                              f"{loc.offset}): stored in the file of another layer")
    return index


class MtpPart:
    """The container's multi-token-prediction head (mtp/): dense tensors and expert records."""

    def __init__(self, container: Container, meta: dict[str, Any], sizes: dict[str, int]) -> None:
        args = container.args
        m = _keys(meta, MTP_KEYS, MTP_OPTIONAL, f"{MANIFEST}: mtp")
        if not isinstance(m["layers"], int) or m["layers"] <= 0 or m["dtype"] not in MTP_ALLOWED:
            raise FormatError(f"{MANIFEST}: mtp: unsupported head {m} (int8, bf16 or f32; never int4)")
        self.layers: int = m["layers"]
        self.dtype: QDType = m["dtype"]
        self.group_size = int(m["group_size"])
        self.hidden_first = bool(m["hidden_first"])
        self.quant_error: dict[str, Any] = dict(m.get("quant_error") or {})
        self.expert_layers = mtp_expert_layers(args, self.layers)
        files = container.files
        if MTP_INDEX not in files:
            raise FormatError(f"{MANIFEST}: files does not list {MTP_INDEX}")
        quant = {**container.quantization, "group_size": self.group_size}
        self.index = _container_index(container.path, _load_json(container.path / MTP_INDEX, MTP_INDEX), args,
                                      quant, sizes, experts_dir=MTP_EXPERTS_DIR, label=MTP_INDEX,
                                      layers=self.expert_layers, dtype=self.dtype)
        assert self.index.layout is not None  # checked against the head's
        self.layout: RecordLayout = self.index.layout
        for rel in self.index.files:
            if f"{MTP_EXPERTS_DIR}/{rel}" not in files:
                raise FormatError(f"{MANIFEST}: files does not list {MTP_EXPERTS_DIR}/{rel}")
        self.specs = planned_mtp(args, self.layers, self.dtype, self.group_size)
        self.dense_files: list[DenseFile] = []
        self._where: dict[str, DenseFile] = {}
        for rel in sorted(r for r in files if r.startswith(MTP_DIR + "/") and r.endswith(".safetensors")):
            df = DenseFile(container.path / rel, rel)
            self.dense_files.append(df)
            for name in df.specs:
                if name in self._where:
                    raise FormatError(f"{rel}: tensor {name!r} also stored in {self._where[name].label}")
                self._where[name] = df
        for name, spec in self.specs.items():
            holder = self._where.get(name)
            if holder is None:
                raise FormatError(f"MTP tensor {name!r} is missing from {MTP_DIR}/")
            if holder.specs[name] != spec:
                got = holder.specs[name]
                raise FormatError(f"{holder.label}: tensor {name!r} is {got.dtype}{list(got.shape)}, expected "
                                  f"{spec.dtype}{list(spec.shape)}")
        extra = sorted(set(self._where) - set(self.specs))
        if extra:
            raise FormatError(f"{self._where[extra[0]].label}: tensor {extra[0]!r} is not part of this MTP head")

    @property
    def expert_bytes(self) -> int:
        return len(self.index) * self.layout.record_bytes

    @property
    def dense_bytes(self) -> int:
        return sum(sum(int(np.prod(sh)) * (4 if t == "F32" else 2 if t in ("F16", "U16") else 1)
                       for _, t, sh in spec.entries()) for spec in self.specs.values())

    def dense(self, name: str) -> QTensor:
        df = self._where.get(name)
        if df is None:
            raise FormatError(f"no MTP tensor {name!r}")
        return df.get(name)

    def close(self) -> None:
        for df in self.dense_files:
            df.close()


class Container:
    """An opened, validated container directory."""

    def __init__(self, path: Path, manifest: dict[str, Any], partial_experts: bool = False) -> None:
        self.path = path
        # Expert files (names in experts/) absent from this directory: a shard of the model's
        # experts (an expert store given some layers' files). Only with partial_experts.
        self.absent_experts: set[str] = set()
        self.manifest = manifest
        m = manifest
        try:
            self.args = ModelArgs.from_dict(m["model"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise FormatError(f"{MANIFEST}: model: {e!r}"[:300]) from e
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
            if p.is_absolute() or ".." in p.parts or rel == MANIFEST or not within(path, path / rel):
                raise FormatError(f"{MANIFEST}: file path {rel!r} is outside the container")
            ent = _keys(ent, {"size", CHECKSUM}, set(), f"{MANIFEST}: files[{rel!r}]")
            try:
                size = (path / rel).stat().st_size
            except FileNotFoundError:
                if not (partial_experts and _is_expert_file(rel)):
                    raise FormatError(f"{rel}: listed in {MANIFEST} but missing") from None
                self.absent_experts.add(rel[len(EXPERTS_DIR) + 1:])
                size = ent["size"]  # its records are not served (see `absent_experts`)
            if size != ent["size"]:
                raise FormatError(f"{rel}: {size} bytes, {MANIFEST} says {ent['size']} (truncated or replaced?)")
            sizes[rel] = size
        if INDEX not in files:
            raise FormatError(f"{MANIFEST}: files does not list {INDEX}")
        self.index = _container_index(path, _load_json(path / INDEX, INDEX), self.args, q, sizes)
        assert self.index.layout is not None  # checked against the model's
        self.layout: RecordLayout = self.index.layout
        self.expert_bytes = _int(m["expert_bytes"], f"{MANIFEST}: expert_bytes")
        if self.expert_bytes != len(self.index) * self.layout.record_bytes:
            raise FormatError(f"{MANIFEST}: expert_bytes {self.expert_bytes} != records x record size")
        for rel in self.index.files:
            if f"{EXPERTS_DIR}/{rel}" not in files:
                raise FormatError(f"{MANIFEST}: files does not list {EXPERTS_DIR}/{rel}")
        self._open_dense(sorted(r for r in files if r.startswith(DENSE_DIR + "/") and r.endswith(".safetensors")))
        self._fds: dict[str, int] = {}
        self.mtp: MtpPart | None = MtpPart(self, m["mtp"], sizes) if "mtp" in m else None

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
    def open(cls, path: str | os.PathLike[str], verify: bool = False, *, partial_experts: bool = False) -> Container:
        """partial_experts: the directory may lack some experts/*.bin files (an expert store's
        shard); they are listed in `absent_experts` and their records must not be read."""
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
        c = cls(root, m, partial_experts)
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
    def index_of(self, layer: int) -> ExpertIndex:
        """The index holding `layer`'s records: the model's, or the MTP head's."""
        if self.mtp is not None and layer in self.mtp.expert_layers:
            return self.mtp.index
        return self.index

    def read_expert_bytes(self, layer: int, expert: int, verify: bool = True) -> bytes:
        """One record (of the model's layers, or of its MTP head's: layers num_layers + k)."""
        index = self.index_of(layer)
        loc = index.location((layer, expert))
        path = index.root / loc.path
        fd = self._fds.get(str(path))
        if fd is None:
            fd = self._fds[str(path)] = os.open(path, os.O_RDONLY)
        buf = os.pread(fd, loc.length, loc.offset)
        if len(buf) != loc.length:
            raise DataCorruption(f"{path}: short read for layer {layer} expert {expert} at "
                                 f"offset {loc.offset}: {len(buf)} of {loc.length} bytes")
        if verify:
            got = xxh3_hex(buf)
            if got != loc.checksum_hex:
                raise DataCorruption(f"{path}: checksum mismatch for layer {layer} expert {expert} "
                                     f"at offset {loc.offset} ({loc.length} bytes): expected {loc.checksum_hex}, "
                                     f"got {got}")
        return buf

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> ExpertWeights:
        buf = np.frombuffer(self.read_expert_bytes(layer, expert, verify), dtype=np.uint8)
        mtp = self.mtp is not None and layer in self.mtp.expert_layers
        return (self.mtp.layout if mtp and self.mtp is not None else self.layout).parse(buf)

    def verify(self) -> None:
        """Recheck every expert record and every file against the index and the manifest."""
        for idx in [self.index, *([self.mtp.index] if self.mtp is not None else [])]:
            for layer, expert in idx.records:
                self.read_expert_bytes(layer, expert, verify=True)
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
        if self.mtp is not None:
            self.mtp.close()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
