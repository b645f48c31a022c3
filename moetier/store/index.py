"""Where each expert record lives: the store's view of the container's expert index.

The store needs, per (layer, expert), one `RecordLocation` (file relative to the
experts directory, byte offset, byte length, xxh3_64 checksum), the index identity
(what mirrors are validated against) and, optionally, a `parse(buffer) -> value`
that turns a verified record buffer into what compute uses (the container's
`RecordLayout.parse`, zero-copy `ExpertWeights`). Without `parse` the tier hands out
the raw uint8 record buffers.

`ExpertIndex` is built from an open container (`from_container`), from a bare
experts/index.json (`from_dir`, the format in docs/internals.md; synthetic record
sets), from either by path (`open_index`), or from a list of records.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError, NotFound

if TYPE_CHECKING:
    from moetier.weights.container import Container

ExpertKey = tuple[int, int]  # (layer, expert)
RecordParser = Callable[[npt.NDArray[np.uint8]], Any]

ALIGN = 4096  # records start on and are padded to this boundary (one aligned O_DIRECT read)


@dataclass(frozen=True)
class RecordLocation:
    path: str  # file name relative to the experts directory (a mirror holds the same names)
    offset: int  # byte offset, a multiple of ALIGN
    length: int  # byte length, a multiple of ALIGN
    checksum: int  # xxh3_64 of the `length` bytes

    @classmethod
    def make(cls, path: str, offset: int, length: int, checksum: int | str) -> RecordLocation:
        c = int(checksum, 16) if isinstance(checksum, str) else int(checksum)
        return cls(str(path), int(offset), int(length), c)


@dataclass
class ExpertIndex:
    """Every expert record of a model, plus what the store needs to serve them."""

    root: Path  # the primary experts directory
    records: dict[ExpertKey, RecordLocation]
    identity: str = ""
    parse: RecordParser | None = None
    layers: tuple[int, ...] = field(init=False)  # MoE layer ids, ascending
    n_experts: int = field(init=False)  # experts per layer (ids 0..n_experts-1)
    files: tuple[str, ...] = field(init=False)
    record_bytes: int = field(init=False)  # the largest record (buffer size)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.records:
            raise FormatError(f"{self.root}: the expert index holds no records")
        for (layer, expert), loc in self.records.items():
            if loc.offset % ALIGN or loc.length % ALIGN or loc.length <= 0:
                raise FormatError(f"{self.root / loc.path}: record of layer {layer} expert {expert} at offset "
                                  f"{loc.offset}, length {loc.length} is not {ALIGN}-byte aligned")
            if Path(loc.path).is_absolute() or ".." in Path(loc.path).parts:
                raise FormatError(f"expert index: record file {loc.path!r} is outside the experts directory")
        self.layers = tuple(sorted({k[0] for k in self.records}))
        self.n_experts = max(k[1] for k in self.records) + 1
        self.files = tuple(sorted({r.path for r in self.records.values()}))
        self.record_bytes = max(r.length for r in self.records.values())

    def location(self, key: ExpertKey) -> RecordLocation:
        try:
            return self.records[key]
        except KeyError:
            raise NotFound(f"no expert {key[1]} in layer {key[0]} (layers {self.layers[0]}..{self.layers[-1]}, "
                           f"{self.n_experts} experts)") from None

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
        return cls(Path(root), dict(records), identity, parse)

    @classmethod
    def from_dir(cls, model_dir: Path | str, parse: RecordParser | None = None) -> ExpertIndex:
        """Read experts/index.json of a container (or an experts directory) without the container reader."""
        d = Path(model_dir)
        experts = d / "experts" if (d / "experts" / "index.json").exists() else d
        path = experts / "index.json"
        try:
            doc = json.loads(path.read_text())
            files = [str(f) for f in doc["files"]]
            if doc.get("checksum", "xxh3_64") != "xxh3_64":
                raise FormatError(f"{path}: unsupported checksum {doc['checksum']!r}")
            records = {
                (int(r[0]), int(r[1])): RecordLocation.make(files[int(r[2])], r[3], r[4], r[5])
                for r in doc["records"]
            }
            identity = str(doc.get("identity", ""))
        except FileNotFoundError:
            raise NotFound(f"{d}: no experts/index.json (not a moetier container?)") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: malformed expert index ({e!r})") from e
        return cls(experts, records, identity, parse)

    @classmethod
    def from_container(cls, container: Container) -> ExpertIndex:
        """From an open container: its validated index, identity and record layout parser."""
        root = Path(container.path) / "experts"
        records = {
            (loc.layer, loc.expert): RecordLocation.make(str(PurePosixPath(loc.file).relative_to("experts")),
                                                         loc.offset, loc.length, loc.checksum)
            for loc in container.index
        }
        return cls(root, records, container.index.identity, container.layout.parse)


def open_index(model_dir: Path | str) -> ExpertIndex:
    """A container (moetier.json present: validated, with its parser) or a bare record set."""
    d = Path(model_dir)
    if (d / "moetier.json").is_file():
        from moetier.weights.container import Container

        with Container.open(d) as c:
            return ExpertIndex.from_container(c)
    return ExpertIndex.from_dir(d)
