"""Usage history of the learned policy, persisted across restarts.

File layout (little-endian):
    magic     8 bytes  b"MTHIST01"
    length    u64      payload bytes
    checksum  u64      xxh3_64 of the payload
    payload   .npz (no pickle): identity (str), layers int32 [L], counts float32 [L, E]

Written atomically (temporary file, fsync, rename, fsync of the directory), so a
reader sees the old file or the new one. A file that is torn, fails its checksum,
or belongs to another model (identity, layers or expert count differ) is
reported and ignored: the policy then starts from no history.
"""

from __future__ import annotations

import io
import logging
import math
import os
import struct
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npformat
import numpy.typing as npt
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"MTHIST01"
_HEADER = struct.Struct("<8sQQ")


def save_history(path: Path | str, counts: npt.NDArray[np.float64], layers: Sequence[int], identity: str) -> None:
    buf = io.BytesIO()
    np.savez(buf, identity=np.array(identity), layers=np.asarray(layers, dtype=np.int32),
             counts=np.asarray(counts, dtype=np.float32))
    payload = buf.getvalue()
    data = _HEADER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def load_history(path: Path | str, layers: Sequence[int], n_experts: int,
                 identity: str) -> npt.NDArray[np.float64] | None:
    """The counts [L, E] saved for this model, or None (missing, torn, corrupt or another model's)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("usage history %s unreadable (%s); starting without history", path, e)
        return None
    why = _check(data)
    if why:
        log.warning("usage history %s ignored: %s", path, why)
        return None
    try:
        z = _arrays(data[_HEADER.size:])
        ident, lay, counts = z["identity"], z["layers"], z["counts"]
    except (OSError, KeyError, ValueError, EOFError, RuntimeError, NotImplementedError, struct.error,
            zipfile.BadZipFile) as e:
        log.warning("usage history %s ignored: unreadable payload (%s)", path, e)
        return None
    if ident.dtype.kind != "U" or lay.dtype != np.int32 or counts.dtype != np.float32:
        log.warning("usage history %s ignored: arrays of dtypes %s, %s, %s (expected str, int32, float32)",
                    path, ident.dtype, lay.dtype, counts.dtype)
        return None
    if (str(ident) != identity or lay.shape != (len(layers),) or lay.tolist() != list(layers)
            or counts.shape != (len(layers), n_experts)):
        log.warning("usage history %s ignored: it belongs to another model (identity %s, counts %s)",
                    path, str(ident) or "-", list(counts.shape))
        return None
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        log.warning("usage history %s ignored: invalid counts", path)
        return None
    log.info("usage history %s loaded (%d uses)", path, int(counts.sum()))
    return counts.astype(np.float64)


def _arrays(payload: bytes) -> dict[str, npt.NDArray[Any]]:
    """The payload's arrays. Each member's .npy header is read and checked against the bytes the
    member holds before anything is allocated (np.load would allocate what a header declares):
    stored members only, no object dtypes, the declared shape's bytes present."""
    out: dict[str, npt.NDArray[Any]] = {}
    with zipfile.ZipFile(io.BytesIO(payload)) as z:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            if name not in ("identity", "layers", "counts"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"member {info.filename} is compressed")
            with z.open(info) as f:
                version = npformat.read_magic(f)
                shape, fortran, dtype = (npformat.read_array_header_1_0(f) if version == (1, 0)
                                         else npformat.read_array_header_2_0(f))
                if dtype.hasobject:
                    raise ValueError(f"member {info.filename} holds objects")
                need = math.prod(shape) * dtype.itemsize
                raw = f.read(min(need, info.file_size) + 1)
            if len(raw) != need:
                raise ValueError(f"member {info.filename} holds {len(raw)} bytes, its header declares {need}")
            out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return out


def _check(data: bytes) -> str:
    if len(data) < _HEADER.size:
        return f"truncated ({len(data)} bytes)"
    magic, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a usage history file"
    if len(data) != _HEADER.size + length:
        return f"torn ({len(data) - _HEADER.size} payload bytes, header says {length})"
    if xxhash.xxh3_64_intdigest(data[_HEADER.size:]) != checksum:
        return "checksum mismatch"
    return ""
