"""Copies of the expert files: the primary experts directory and optional mirrors.

A mirror is a directory holding some or all of the primary's expert files (a
container directory or its `experts/` folder). At start-up a mirror is checked
against the primary: its index identity (when it carries an index.json) must
match, and only files of exactly the primary's size are used, so a partial or
half-copied mirror serves what it validly holds.

Placement: each record is read from the copy chosen by weighted rendezvous
hashing of (layer, expert) over the healthy copies holding its file, so the
choice is deterministic, spreads reads in proportion to the weights (probed
bandwidth or configured), and moves only the affected records when a copy
comes or goes. On a failed read the next choice is the primary.

A read error, a missing file or a file unlinked while open (a removed mirror
directory: Linux keeps serving the open file, so `st_nlink == 0` is checked)
marks the mirror degraded; it is re-validated after `reprobe_interval_s` by the
next read that considers it. The primary is never degraded: it is the authority.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import xxhash

from moetier.errors import FormatError, NotFound
from moetier.store.buffers import Buffer, alloc_aligned
from moetier.store.stats import DiskStats
from moetier.weights.format import RECORD_ALIGN
from moetier.weights.index import ExpertIndex, ExpertKey, RecordLocation, read_identity

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class CopyMissing(OSError):
    """The copy does not hold the file (any more)."""


@dataclass
class Copy:
    name: str
    role: Literal["primary", "mirror"]
    root: Path  # experts directory of this copy
    stats: DiskStats
    fds: dict[str, int] = field(default_factory=dict)  # file name -> fd of a valid file
    direct: dict[str, bool] = field(default_factory=dict)  # file name -> opened with O_DIRECT
    retry_at: float = 0.0  # when a degraded mirror is next re-validated
    lock: threading.Lock = field(default_factory=threading.Lock)  # fds and state changes
    stats_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def healthy(self) -> bool:
        return self.stats.state == "ok"


def experts_dir(path: Path) -> Path:
    """A mirror may be given as a container directory or as its experts/ folder. One that cannot
    even be looked into (no permission) is taken as given: its validation then finds no file
    and degrades it, where an exception here would stop the store from starting."""
    try:
        return path / "experts" if (path / "experts").is_dir() else path
    except OSError:
        return path


def open_record_file(path: Path, direct: bool) -> tuple[int, bool, str]:
    """Open for record reads: (fd, O_DIRECT in use, why not when it was wanted)."""
    if direct and _O_DIRECT:
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            reason = f"the filesystem refuses O_DIRECT ({e.strerror})"
        else:
            try:  # some filesystems accept the flag but fail the reads
                probe = alloc_aligned(RECORD_ALIGN)
                os.preadv(fd, [probe.data], 0)
                return fd, True, ""
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
                reason = f"O_DIRECT reads fail with {e.strerror}"
    else:
        reason = "buffered reads requested" if direct is False else "O_DIRECT is not available on this platform"
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False, reason


def read_exact(fd: int, buf: Buffer, offset: int, length: int) -> None:
    """One positional read of `length` bytes into buf[:length] (looping only on short reads)."""
    mv = buf.data[:length]
    got = 0
    while got < length:
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n <= 0:
            raise OSError(errno.EIO, f"short read: {got} of {length} bytes at offset {offset} (file truncated?)")
        got += n


class CopySet:
    def __init__(
        self,
        index: ExpertIndex,
        mirrors: Sequence[Path | str] = (),
        *,
        direct: bool = True,
        weights: Sequence[float] | None = None,
        reprobe_interval_s: float = 10.0,
    ) -> None:
        """weights: one per copy (primary first) or None for equal weights until `probe` runs."""
        self.index = index
        self.want_direct = direct
        self.reprobe_interval_s = reprobe_interval_s
        self.extents = index.file_extents()
        self.sizes: dict[str, int] = {}
        primary = Copy("primary", "primary", index.root, DiskStats("primary", str(index.root), "primary"))
        for name in index.files:
            path = index.root / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise NotFound(f"expert file {path} is missing") from None
            if size < self.extents[name]:
                raise FormatError(f"expert file {path} holds {size} bytes, its records need {self.extents[name]}")
            self.sizes[name] = size
        self._open_files(primary, index.files)
        self.copies: list[Copy] = [primary]
        for i, m in enumerate(mirrors):
            root = experts_dir(Path(m))
            c = Copy(f"mirror{i}", "mirror", root, DiskStats(f"mirror{i}", str(root), "mirror"))
            self.copies.append(c)
            if not self._validate(c):
                self._set_degraded(c, "no valid expert file at start-up")
        if weights is not None:
            if len(weights) != len(self.copies) or any(w <= 0 for w in weights):
                raise ValueError(f"need {len(self.copies)} positive copy weights, got {list(weights)}")
            for c, w in zip(self.copies, weights, strict=True):
                c.stats.weight = float(w)

    @property
    def primary(self) -> Copy:
        return self.copies[0]

    # ---- files ----------------------------------------------------------------------
    def _open_files(self, copy: Copy, names: Sequence[str]) -> None:
        reasons: set[str] = set()
        for name in names:
            fd, direct, why = open_record_file(copy.root / name, self.want_direct)
            copy.fds[name], copy.direct[name] = fd, direct
            if why and self.want_direct:
                reasons.add(why)
        copy.stats.files = len(copy.fds)
        copy.stats.direct = bool(copy.direct) and all(copy.direct.values())
        for why in reasons:
            log.warning("%s (%s): buffered reads, %s", copy.name, copy.root, why)

    def _close_files(self, copy: Copy) -> None:
        for fd in copy.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        copy.fds.clear()
        copy.direct.clear()

    def _validate(self, copy: Copy) -> bool:
        """(Re)open the files a mirror validly holds; False when it holds none."""
        self._close_files(copy)
        ident = read_identity(copy.root)
        if ident is not None and self.index.identity and ident != self.index.identity:
            log.warning("%s (%s): index identity %s differs from the model's %s; not used",
                        copy.name, copy.root, ident, self.index.identity)
            copy.stats.files = 0
            return False
        valid = []
        for name, size in self.sizes.items():
            try:
                if (copy.root / name).stat().st_size == size:
                    valid.append(name)
            except OSError:
                continue
        try:
            self._open_files(copy, valid)
        except OSError as e:
            log.warning("%s (%s): cannot open expert files: %s", copy.name, copy.root, e)
            self._close_files(copy)
        copy.stats.files = len(copy.fds)
        if copy.fds:
            log.info("%s (%s): %d of %d expert files", copy.name, copy.root, len(copy.fds), len(self.sizes))
        return bool(copy.fds)

    # ---- health ---------------------------------------------------------------------
    def _set_degraded(self, copy: Copy, reason: str) -> None:
        copy.stats.state = "degraded"
        copy.stats.degraded_total += 1
        copy.retry_at = time.monotonic() + self.reprobe_interval_s
        log.warning("%s (%s) degraded: %s; reads go to the other copies, re-check in %.0f s",
                    copy.name, copy.root, reason, self.reprobe_interval_s)

    def degrade(self, copy: Copy, reason: str) -> None:
        if copy.role == "primary":
            return
        with copy.lock:
            if copy.healthy:
                self._set_degraded(copy, reason)

    def _maybe_reprobe(self, copy: Copy) -> None:
        if time.monotonic() < copy.retry_at or not copy.lock.acquire(blocking=False):
            return
        try:
            if copy.healthy or time.monotonic() < copy.retry_at:
                return
            if self._validate(copy):
                copy.stats.state = "ok"
                copy.stats.recovered_total += 1
                log.info("%s (%s) recovered", copy.name, copy.root)
            else:
                copy.retry_at = time.monotonic() + self.reprobe_interval_s
        finally:
            copy.lock.release()

    # ---- placement and reads --------------------------------------------------------
    def order(self, key: ExpertKey, loc: RecordLocation) -> list[Copy]:
        """Copies to try for one record: the weighted-rendezvous choice, then the primary,
        then the other healthy copies holding the file."""
        for c in self.copies[1:]:
            if not c.healthy:
                self._maybe_reprobe(c)
        cands = [c for c in self.copies if c.healthy and loc.path in c.fds]
        if len(cands) == 1:
            return cands
        scored = sorted(cands, key=lambda c: self._score(c, key))
        first = scored[0]
        rest = [c for c in scored[1:] if c.role == "primary"] + [c for c in scored[1:] if c.role != "primary"]
        return [first, *rest]

    @staticmethod
    def _score(copy: Copy, key: ExpertKey) -> float:
        """Weighted rendezvous: the copy with the smallest -ln(u)/w wins, P(win) = w / sum(w)."""
        h = xxhash.xxh3_64_intdigest(f"{copy.name}/{key[0]}/{key[1]}".encode())
        u = (h + 0.5) / 2.0**64
        return -math.log(u) / copy.stats.weight

    def read(self, copy: Copy, loc: RecordLocation, buf: Buffer) -> None:
        fd = copy.fds.get(loc.path)
        if fd is None:
            raise CopyMissing(errno.ENOENT, f"{copy.root / loc.path} is not held by {copy.name}")
        if copy.role == "mirror" and os.fstat(fd).st_nlink == 0:
            raise CopyMissing(errno.ENOENT, f"{copy.root / loc.path} was removed")
        read_exact(fd, buf, loc.offset, loc.length)

    def set_weights(self, weights: Sequence[float]) -> None:
        for c, w in zip(self.copies, weights, strict=True):
            c.stats.weight = max(float(w), 1e-3)

    def close(self) -> None:
        for c in self.copies:
            with c.lock:
                self._close_files(c)
