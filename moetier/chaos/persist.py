"""What the cluster has persisted, read from its files, to tell afterwards whether a fault lost any
of it: the prefix cache's entries (a valid file: preamble, sizes and xxh3_64 as
moetier/prefix_cache.py writes them, and its token ids) and the usage history's total count.

An entry present before a fault is lost when, after it, no valid file holds its tokens or a
longer sequence starting with them (the prefix cache drops an entry that a newer one extends).
Files the fault damaged on purpose are not counted."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

_PRE = struct.Struct("<8sQQQ")
PREFIX_MAGIC = b"MTPFXKV1"
_HIST = struct.Struct("<8sQQ")
HIST_MAGIC = b"MTHIST01"


def prefix_entry(path: Path) -> tuple[int, ...] | None:
    """The token ids of a valid prefix-cache file, else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _PRE.size:
        return None
    magic, hlen, plen, checksum = _PRE.unpack_from(data)
    if magic != PREFIX_MAGIC or len(data) != _PRE.size + hlen + plen:
        return None
    if xxhash.xxh3_64_intdigest(data[_PRE.size:]) != checksum:
        return None
    try:
        header = json.loads(data[_PRE.size:_PRE.size + hlen].rstrip(b"\0"))
        spec = next(a for a in header["arrays"] if a["name"] == "tokens")
        start = _PRE.size + hlen + int(spec["offset"])
        tokens = np.frombuffer(data[start:start + int(spec["nbytes"])], dtype=np.dtype(spec["dtype"]))
    except (ValueError, KeyError, TypeError, StopIteration):
        return None
    return tuple(int(t) for t in tokens)


def history_total(path: Path) -> float | None:
    """The total use count of a valid usage-history file, else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HIST.size:
        return None
    magic, plen, checksum = _HIST.unpack_from(data)
    payload = data[_HIST.size:]
    if magic != HIST_MAGIC or plen != len(payload) or xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            return float(np.asarray(z["counts"], dtype=np.float64).sum())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None


@dataclass
class Persisted:
    entries: dict[str, tuple[int, ...]] = field(default_factory=dict)  # file name -> tokens
    history: float | None = None

    @classmethod
    def read(cls, prefix_dir: Path, history: Path) -> Persisted:
        entries = {}
        for p in sorted(prefix_dir.glob("*.kv")) if prefix_dir.is_dir() else []:
            tokens = prefix_entry(p)
            if tokens is not None:
                entries[p.name] = tokens
        return cls(entries, history_total(history))

    def lost(self, after: Persisted, damaged: set[str]) -> list[str]:
        """What of self (before) `after` no longer holds, less the files in `damaged`."""
        out = []
        kept = list(after.entries.values())
        for name, tokens in self.entries.items():
            if name in damaged:
                continue
            if not any(t[:len(tokens)] == tokens for t in kept):
                out.append(f"prefix-cache entry {name} ({len(tokens)} tokens)")
        if self.history is not None and "history" not in damaged:
            if after.history is None:
                out.append("usage history (file gone or invalid)")
            elif after.history < self.history:
                out.append(f"usage history counts ({after.history:.0f} < {self.history:.0f} before)")
        return out
