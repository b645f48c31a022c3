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
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
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
        with np.load(io.BytesIO(data[_HEADER.size:]), allow_pickle=False) as z:
            ident, lay, counts = str(z["identity"]), z["layers"], z["counts"]
    except (OSError, KeyError, ValueError) as e:
        log.warning("usage history %s ignored: unreadable payload (%s)", path, e)
        return None
    if ident != identity or list(lay) != list(layers) or counts.shape != (len(layers), n_experts):
        log.warning("usage history %s ignored: it belongs to another model (identity %s, %d layers x %d experts)",
                    path, ident or "-", counts.shape[0], counts.shape[-1])
        return None
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        log.warning("usage history %s ignored: invalid counts", path)
        return None
    log.info("usage history %s loaded (%d uses)", path, int(counts.sum()))
    return counts.astype(np.float64)


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
