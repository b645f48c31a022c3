"""experts/index.json: where every expert record lives. The one reader of that file and the
one record location type, shared by the container reader, the I/O engine, the RAM tier and
the expert store.

    index = ExpertIndex.load(model_dir / "experts")       # a bare record set (synth, bench io)
    index = container.index                               # a container's (its layout checked too)
    loc = index.location((layer, expert))                 # RecordLocation(path, offset, length, checksum)
    weights = index.parse(buffer)                         # a verified record buffer -> ExpertWeights

The file (docs/internals.md, 'experts/index.json') is validated loudly, every error naming
the file and, where it applies, the record's layer, expert, file and offset: the fields, the
format version and checksum kind, the identity (recomputed over layout + files + records),
every record (no duplicate, a known MoE layer and expert, 4 KiB aligned, inside its file) and
completeness (every expert of every MoE layer). A container adds what only its manifest knows
(`Container` checks the layout against the model's shape and quantization).

`layout` is null for a bare record set (tests, `moetier bench io --synthetic`): its records
are handed out as raw uint8 buffers unless a `parse` is given.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError, NotFound
from moetier.weights.format import (
    CHECKSUM,
    FORMAT_VERSION,
    INDEX_KEYS,
    RECORD_ALIGN,
    canonical_json,
    xxh3_hex,
)
from moetier.weights.layout import RecordLayout

ExpertKey = tuple[int, int]  # (layer, expert)
RecordParser = Callable[[npt.NDArray[np.uint8]], Any]

INDEX_FILE = "index.json"  # inside the experts directory


@dataclass(frozen=True)
class RecordLocation:
    path: str  # file name relative to the experts directory (a mirror holds the same names)
    offset: int  # byte offset, a multiple of RECORD_ALIGN
    length: int  # byte length, a multiple of RECORD_ALIGN
    checksum: int  # xxh3_64 of the `length` bytes

    @property
    def checksum_hex(self) -> str:
        return f"{self.checksum:016x}"


def index_identity(layout: dict[str, Any] | None, files: list[str], records: list[list[Any]]) -> str:
    """xxh3_64 hex over the canonical JSON of layout + files + records (what mirrors are checked against)."""
    return xxh3_hex(canonical_json({"layout": layout, "files": files, "records": records}))


@dataclass
class ExpertIndex:
    """Every expert record of a model: (layer, expert) -> RecordLocation, and how to parse one."""

    root: Path  # the primary experts directory
    records: dict[ExpertKey, RecordLocation]
    identity: str = ""
    parse: RecordParser | None = None  # verified record buffer -> what compute uses (None: the raw buffer)
    layout: RecordLayout | None = None  # the record layout every record shares (None: a bare record set)
    layers: tuple[int, ...] = field(init=False)  # MoE layer ids, ascending
    n_experts: int = field(init=False)  # experts per layer (ids 0..n_experts-1)
    files: tuple[str, ...] = field(init=False)  # record files, sorted
    record_bytes: int = field(init=False)  # the largest record (buffer size)
    total_bytes: int = field(init=False)  # every record's bytes

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.records:
            raise FormatError(f"{self.root}: the expert index holds no records")
        for (layer, expert), loc in self.records.items():
            if loc.offset % RECORD_ALIGN or loc.length % RECORD_ALIGN or loc.length <= 0:
                raise FormatError(f"{self.root / loc.path}: record of layer {layer} expert {expert} at offset "
                                  f"{loc.offset}, length {loc.length} is not {RECORD_ALIGN}-byte aligned")
            if not _inside(loc.path):
                raise FormatError(f"expert index: record file {loc.path!r} is outside the experts directory")
        if self.parse is None and self.layout is not None:
            self.parse = self.layout.parse
        self.layers = tuple(sorted({k[0] for k in self.records}))
        self.n_experts = max(k[1] for k in self.records) + 1
        self.files = tuple(sorted({r.path for r in self.records.values()}))
        self.record_bytes = max(r.length for r in self.records.values())
        self.total_bytes = sum(r.length for r in self.records.values())

    def location(self, key: ExpertKey) -> RecordLocation:
        try:
            return self.records[key]
        except KeyError:
            raise NotFound(f"no expert {key[1]} in layer {key[0]} (layers {self.layers[0]}..{self.layers[-1]}, "
                           f"{self.n_experts} experts)") from None

    def __iter__(self) -> Iterator[tuple[ExpertKey, RecordLocation]]:
        return iter(self.records.items())

    def __len__(self) -> int:
        return len(self.records)

    def file_extents(self) -> dict[str, int]:
        """Bytes each file must hold at least (end of its last record)."""
        out: dict[str, int] = {}
        for r in self.records.values():
            out[r.path] = max(out.get(r.path, 0), r.offset + r.length)
        return out

    def layer_row(self) -> dict[int, int]:
        """layer id -> row of per-layer arrays (heat snapshot, history)."""
        return {layer: i for i, layer in enumerate(self.layers)}

    # ---- constructors ---------------------------------------------------------------
    @classmethod
    def from_records(cls, root: Path | str, records: Mapping[ExpertKey, RecordLocation], identity: str = "",
                     parse: RecordParser | None = None) -> ExpertIndex:
        """An index built in code (tests; `write_records` returns one beside the file it writes)."""
        return cls(Path(root), dict(records), identity, parse)

    @classmethod
    def load(cls, experts: Path | str, parse: RecordParser | None = None) -> ExpertIndex:
        """Read and validate `experts`/index.json (an experts directory, or a container directory
        holding one). File sizes are taken from the files themselves."""
        d = Path(experts)
        if not (d / INDEX_FILE).is_file() and (d / "experts" / INDEX_FILE).is_file():
            d = d / "experts"
        path = d / INDEX_FILE
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise NotFound(f"{Path(experts)}: no experts/{INDEX_FILE} (not a moetier container?)") from None
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int past Python's digit limit, deep nesting
            raise FormatError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        index = cls.from_doc(d, doc, None, str(path))
        if parse is not None:
            index.parse = parse
        return index

    @classmethod
    def from_doc(cls, root: Path, doc: Any, sizes: Mapping[str, int] | None, label: str) -> ExpertIndex:
        """Validate a parsed index.json. `sizes`: bytes of each record file (by its name in the
        experts directory); None: stat the files under `root`. `label` names the file in errors."""
        if not isinstance(doc, dict):
            raise FormatError(f"{label}: expected a JSON object")
        missing = sorted(INDEX_KEYS - set(doc))
        if missing:
            raise FormatError(f"{label}: missing field(s) {', '.join(missing)}")
        extra = sorted(set(doc) - INDEX_KEYS)
        if extra:
            raise FormatError(f"{label}: unknown field(s) {', '.join(extra)}")
        if doc["format_version"] != FORMAT_VERSION:
            raise FormatError(f"{label}: format_version {doc['format_version']!r}, this moetier reads {FORMAT_VERSION}")
        if doc["checksum"] != CHECKSUM:
            raise FormatError(f"{label}: checksum {doc['checksum']!r} unsupported (expected {CHECKSUM})")
        files, layers, n_experts = doc["files"], doc["moe_layers"], doc["n_experts"]
        if not (isinstance(files, list) and files and all(isinstance(f, str) and _inside(f) for f in files)):
            raise FormatError(f"{label}: files must be a non-empty list of file names inside the experts directory")
        if len(set(files)) != len(files):
            raise FormatError(f"{label}: files lists a file twice")
        if not (isinstance(layers, list) and layers and all(_is_int(x) and x >= 0 for x in layers)
                and layers == sorted(set(layers))):
            raise FormatError(f"{label}: moe_layers must be ascending, distinct layer ids")
        if not (_is_int(n_experts) and n_experts > 0):
            raise FormatError(f"{label}: n_experts must be a positive integer")
        if not isinstance(doc["records"], list):
            raise FormatError(f"{label}: records must be a list")
        layout = None if doc["layout"] is None else RecordLayout.from_dict(doc["layout"])
        if index_identity(doc["layout"], files, doc["records"]) != doc["identity"]:
            raise FormatError(f"{label}: identity does not match its layout, files and records")
        moe = set(layers)
        records: dict[ExpertKey, RecordLocation] = {}
        for rec in doc["records"]:
            try:
                layer, expert, fi, offset, length, ck = rec
                if not all(_is_int(v) for v in (layer, expert, fi, offset, length)) or not 0 <= fi < len(files):
                    raise ValueError("not integers, or no such file index")
                name, checksum = files[fi], int(ck, 16)
            except (ValueError, TypeError) as e:
                raise FormatError(f"{label}: malformed record {rec!r}") from e
            where = f"{label}: record layer {layer} expert {expert} ({name} offset {offset})"
            if (layer, expert) in records:
                raise FormatError(f"{where}: duplicate")
            if layer not in moe or not 0 <= expert < n_experts:
                raise FormatError(f"{where}: no such MoE layer/expert")
            if offset < 0 or offset % RECORD_ALIGN or length <= 0 or length % RECORD_ALIGN:
                raise FormatError(f"{where}: not {RECORD_ALIGN}-aligned (length {length})")
            if layout is not None and length != layout.record_bytes:
                raise FormatError(f"{where}: length {length} != the layout's {layout.record_bytes}")
            size = sizes.get(name, -1) if sizes is not None else _size(root / name)
            if offset + length > size:
                raise FormatError(f"{where}: ends at {offset + length} past the end of the "
                                  f"{max(size, 0)}-byte file")
            records[(layer, expert)] = RecordLocation(name, offset, length, checksum)
        n_want = len(layers) * n_experts
        if len(records) != n_want:
            raise FormatError(f"{label}: {len(records)} records, the index names {len(layers)} MoE layers x "
                              f"{n_experts} experts = {n_want}")
        return cls(root, records, str(doc["identity"]), None, layout)


def read_identity(experts: Path) -> str | None:
    """The identity a copy's index.json claims, unvalidated (a mirror may hold only some of the
    files it lists); None when it has no readable index."""
    try:
        ident = json.loads((experts / INDEX_FILE).read_text()).get("identity", "")
    except (OSError, ValueError, AttributeError):
        return None
    return str(ident) or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _inside(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
