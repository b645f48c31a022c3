"""Page-aligned record buffers for O_DIRECT reads, recycled through a small pool.

O_DIRECT needs the destination aligned to the device's logical block (512 B or
4 KiB); a bytearray is not, an anonymous mmap is (page-aligned). Faulting in a
fresh 4 MiB mapping costs ~0.5 ms, a sizeable fraction of the read itself, so
freed buffers are kept for reuse.

A buffer is recycled only when nobody else holds it: a parsed `ExpertWeights` or
any other numpy view keeps a reference to the buffer array, and such a buffer is
left to the garbage collector instead of being overwritten by the next read.
Placement must never change the math, so an evicted expert still in someone's
hands stays intact.
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

Buffer = npt.NDArray[np.uint8]


def alloc_aligned(nbytes: int) -> Buffer:
    """A zeroed, page-aligned uint8 array of `nbytes` backed by an anonymous mapping."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=flags)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


class BufferPool:
    """Buffers of one size (the largest record, rounded up to a page)."""

    def __init__(self, nbytes: int, max_free: int = 8) -> None:
        self.nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.max_free = max_free
        self._free: list[Buffer] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created (monotonic)
        self.reused = 0  # get() served from the free list (monotonic)
        # References to a buffer held by nobody but `reclaim` itself, measured once by
        # reclaiming a fresh buffer (independent of the interpreter's counting details).
        self._exclusive_refs = 0
        self.reclaim(Holder(alloc_aligned(self.nbytes)))

    def get(self) -> Buffer:
        with self._lock:
            if self._free:
                self.reused += 1
                return self._free.pop()
            self.allocated += 1
        return alloc_aligned(self.nbytes)

    def reclaim(self, holder: Holder | Any, attr: str = "buf", wanted: int = 0) -> bool:
        """Take the buffer out of `holder.attr` (set to None) and keep it for reuse if
        nothing else refers to it. Taking it from its holder, rather than as an argument,
        keeps the count free of the callers' frames. `wanted`: buffers the caller knows
        reads will take soon (a tier evicting to make room for reads it is about to queue),
        kept beyond `max_free` up to that many, so that a burst of evictions is not unmapped
        only for the reads right after it to map and fault in as many fresh buffers. Returns
        whether it was kept."""
        buf = getattr(holder, attr)
        setattr(holder, attr, None)
        if buf is None:
            return False
        refs = sys.getrefcount(buf)
        if not self._exclusive_refs:
            self._exclusive_refs = refs
        if not isinstance(buf, np.ndarray) or buf.nbytes != self.nbytes or refs > self._exclusive_refs:
            return False  # someone still holds a view of it: the GC frees it when they let go
        with self._lock:
            if len(self._free) >= max(self.max_free, wanted):
                return False
            self._free.append(buf)
        return True

    @property
    def free_buffers(self) -> int:
        return len(self._free)


class Holder:
    """A box for handing a buffer to `BufferPool.reclaim`."""

    __slots__ = ("buf",)

    def __init__(self, buf: Buffer | None) -> None:
        self.buf = buf
