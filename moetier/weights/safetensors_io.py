"""Plain safetensors I/O: a validating header parser with zero-copy memmap views, and a
streaming writer that fixes the file's layout up front and enforces its write order.

File layout (the safetensors format): u64 little-endian header length N, N bytes of JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data region. Offsets are relative to the data region, which is fully covered by
the tensors without holes or overlaps.

The writer pads the header with spaces so the data region starts on a 64-byte boundary,
and orders tensors by element size (largest first) then by the caller's order, so every
tensor is naturally aligned for a memmap view.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from moetier.errors import FormatError

# safetensors dtype tag -> numpy dtype as stored (BF16 as raw uint16, F8 as raw uint8)
DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("u1"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
}
TAG_OF: dict[str, str] = {"float32": "F32", "float16": "F16", "uint16": "U16", "int8": "I8", "uint8": "U8"}
MAX_HEADER = 100 * 1024 * 1024
MAX_NDIM = 8  # numpy's own limit is 64; no model tensor has more than a few
DATA_ALIGN = 64


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    begin: int  # offset of the first byte in the file (absolute)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in data order
    metadata: dict[str, str]
    data_start: int
    header_bytes: bytes  # the raw JSON header, for identities


def read_header(path: Path, label: str | None = None) -> Header:
    """Parse and validate a safetensors header; errors name the file (and tensor)."""
    label = label or str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{label}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"{label}: header length {n} does not fit in a {size}-byte file (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"{label}: cannot read: {e.strerror}") from e
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep or too long
        raise FormatError(f"{label}: safetensors header is not valid JSON: {e}"[:300]) from e
    if not isinstance(obj, dict):
        raise FormatError(f"{label}: safetensors header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise FormatError(f"{label}: safetensors __metadata__ is not a JSON object")
    data_start = 8 + n
    infos: list[TensorInfo] = []
    for name, ent in obj.items():
        try:
            tag = ent["dtype"]
            shape = tuple(ent["shape"])
            b, end = ent["data_offsets"]
            if not all(type(x) is int and x >= 0 for x in (*shape, b, end)):
                raise ValueError("shape and data_offsets must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{label}: tensor {name!r} has a malformed header entry ({exc})"[:300]) from exc
        if not isinstance(tag, str) or tag not in DTYPES:
            raise FormatError(f"{label}: tensor {name!r} has unsupported dtype {tag!r}"[:300])
        if len(shape) > MAX_NDIM:
            raise FormatError(f"{label}: tensor {name!r} has {len(shape)} dimensions (at most {MAX_NDIM})")
        want = math.prod(shape) * DTYPES[tag].itemsize  # Python ints: no int64 overflow
        if end - b != want or b < 0:
            raise FormatError(f"{label}: tensor {name!r} spans {end - b} bytes at offset {b}, "
                              f"its shape {list(shape)} {tag} needs {want}")
        if data_start + end > size:
            raise FormatError(f"{label}: tensor {name!r} ends at byte {data_start + end} "
                              f"but the file has {size} bytes (truncated)")
        infos.append(TensorInfo(name, tag, shape, data_start + b, data_start + end))
    infos.sort(key=lambda t: t.begin)
    pos = data_start
    for t in infos:
        if t.begin != pos and t.nbytes:
            raise FormatError(f"{label}: tensor {t.name!r} starts at byte {t.begin}, expected {pos} "
                              "(hole or overlap in the data region)")
        pos = max(pos, t.end)
    return Header(path, {t.name: t for t in infos}, {str(k): str(v) for k, v in meta.items()}, data_start, raw)


class MappedFile:
    """A safetensors file opened read-only with np.memmap; tensors are zero-copy views."""

    def __init__(self, path: Path, label: str | None = None) -> None:
        self.header = read_header(path, label)
        self.label = label or str(path)
        size = path.stat().st_size
        self._mm: np.ndarray = (np.memmap(path, dtype=np.uint8, mode="r") if size
                                else np.zeros(0, dtype=np.uint8))

    def raw(self, name: str, data: np.ndarray | None = None) -> np.ndarray:
        """Stored array (BF16 as uint16, F8 as uint8), a view into the map (or into `data`, the
        whole file's bytes as `read_resident` returns them)."""
        t = self.header.tensors[name]
        src = self._mm if data is None else data
        return src[t.begin:t.end].view(DTYPES[t.dtype]).reshape(t.shape)

    def read_resident(self) -> np.ndarray:
        """The file's bytes in anonymous memory, out of the page cache (`read_resident`)."""
        return read_resident(self.header.path, self.label)

    def close(self) -> None:
        mm = self._mm
        self._mm = np.zeros(0, dtype=np.uint8)
        base = getattr(mm, "_mmap", None)
        if base is not None:
            del mm
            # BufferError: a view is still alive; the map goes away with the last view
            with contextlib.suppress(BufferError, ValueError):
                base.close()


READ_CHUNK = 64 << 20  # bytes per read while loading a file into memory (a multiple of the page size)


def read_resident(path: Path, label: str | None = None) -> np.ndarray:
    """A whole file's bytes in anonymous memory: uint8 [size], read-only, page-aligned (every
    offset keeps the alignment it has in the file). The file's pages are dropped from the page
    cache as they are read (posix_fadvise DONTNEED; pages other processes map stay), so the
    bytes are held once: here, and not again as cache."""
    label = label or str(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise FormatError(f"{label}: cannot read: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=np.uint8)
        mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mem)
        pos = 0
        while pos < size:
            n = os.preadv(fd, [view[pos : pos + READ_CHUNK]], pos)
            if n <= 0:
                raise FormatError(f"{label}: file shrank to {pos} bytes while being read (expected {size})")
            _drop_cached(fd, pos, n)
            pos += n
        _drop_cached(fd, 0, 0)  # and whatever read-ahead brought in beyond the last chunk
        del view
    except OSError as e:
        raise FormatError(f"{label}: cannot read: {e.strerror}") from e
    finally:
        os.close(fd)
    out = np.frombuffer(mem, dtype=np.uint8)  # keeps the mapping alive as long as any view of it
    out.flags.writeable = False
    return out


def _drop_cached(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux and most Unix; elsewhere the page cache keeps its copy
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are all declared up front.

    `entries` fix names, tags and shapes, and so every tensor's place in the file; `write`
    then fills each tensor exactly once, in any order, and `close` checks that all were
    written. The file is written as `path + '.tmp'` and renamed into place after fsync, so
    a reader never sees a partial file under the final name.
    """

    def __init__(self, path: Path, entries: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        ents = list(entries)
        names = [e[0] for e in ents]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}: duplicate tensor names")
        # stable sort: largest element first keeps every tensor naturally aligned
        ents = sorted(ents, key=lambda e: -DTYPES[e[1]].itemsize)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        pos = 0
        places: list[tuple[str, str, tuple[int, ...], int, int]] = []
        for name, tag, shape in ents:
            n = int(np.prod(shape, dtype=np.int64)) * DTYPES[tag].itemsize
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + n]}
            places.append((name, tag, tuple(shape), pos, n))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
        self.path = path
        self.order = [p[0] for p in places]  # data order (sequential writes in this order are fastest)
        self._places = {p[0]: p for p in places}
        self._data_start = 8 + len(raw)
        self.nbytes = self._data_start + pos
        self._written: set[str] = set()
        self._tmp = path.with_name(path.name + ".tmp")
        self._f: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 -- owned until close/abort
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self.nbytes)

    def write(self, name: str, array: np.ndarray) -> None:
        if self._f is None:
            raise RuntimeError(f"{self.path}: writer is closed")
        if name not in self._places:
            raise RuntimeError(f"{self.path}: tensor {name!r} was not declared")
        if name in self._written:
            raise RuntimeError(f"{self.path}: tensor {name!r} written twice")
        _, tag, shape, off, _ = self._places[name]
        a = np.ascontiguousarray(array)
        dt = DTYPES[tag]
        if tuple(a.shape) != shape or (a.dtype.kind, a.dtype.itemsize) != (dt.kind, dt.itemsize):
            raise RuntimeError(f"{self.path}: tensor {name!r} is {a.dtype}{list(a.shape)}, declared {tag}{list(shape)}")
        os.pwrite(self._f.fileno(), a.reshape(-1).view(np.uint8).data, self._data_start + off)
        self._written.add(name)

    def close(self) -> None:
        if self._f is None:
            return
        missing = [n for n in self.order if n not in self._written]
        if missing:
            self.abort()
            raise RuntimeError(f"{self.path}: closed before tensor {missing[0]!r} was written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)


def write_file(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write a whole dict of arrays, dtype tags taken from the numpy dtypes (uint16 -> U16)."""
    ents = [(k, TAG_OF[np.dtype(v.dtype).name], tuple(v.shape)) for k, v in tensors.items()]
    w = SafetensorsWriter(path, ents, metadata)
    for name in w.order:
        w.write(name, tensors[name])
    w.close()
