"""Test support for moetier.store: small record files and an instrumented disk.

`Disk(engine)` wraps the engine's reads: it records every read (copy, file,
offset), tracks how many are in progress (peak), and can hold reads at a gate
until the test opens it, which is how tests observe single-flight, batching and
priorities deterministically.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from moetier.store.buffers import Buffer
from moetier.store.copies import Copy
from moetier.store.io import IOEngine
from moetier.store.synth import write_records
from moetier.weights.index import ExpertIndex, ExpertKey, RecordLocation

REC = 8192  # record bytes of the test files (two 4 KiB blocks)


def records(tmp: Path, layers: tuple[int, ...] = (1, 2), n_experts: int = 8, record_bytes: int = REC,
            **kw: object) -> ExpertIndex:
    return write_records(tmp / "model", layers, n_experts, record_bytes, **kw)  # type: ignore[arg-type]


def file_bytes(index: ExpertIndex, key: ExpertKey) -> bytes:
    loc = index.records[key]
    with open(index.root / loc.path, "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.length)


def corrupt(root: Path, loc: RecordLocation, at: int = 100) -> bytes:
    """Flip one byte of a record in the copy under `root`; returns the original record."""
    path = root / loc.path
    with open(path, "r+b") as f:
        f.seek(loc.offset)
        orig = f.read(loc.length)
        f.seek(loc.offset + at)
        f.write(bytes([orig[at] ^ 0xFF]))
        f.flush()
    return orig


def restore(root: Path, loc: RecordLocation, data: bytes) -> None:
    with open(root / loc.path, "r+b") as f:
        f.seek(loc.offset)
        f.write(data)


class Disk:
    def __init__(self, engine: IOEngine, hold: bool = False) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, int]] = []
        self.active = 0
        self.peak = 0
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self._orig: Callable[[Copy, RecordLocation, Buffer], None] = engine.copies.read
        engine.copies.read = self.read  # type: ignore[method-assign]

    def read(self, copy: Copy, loc: RecordLocation, buf: Buffer) -> None:
        with self.lock:
            self.calls.append((copy.name, loc.path, loc.offset))
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            assert self.gate.wait(10), "test gate never opened"
            self._orig(copy, loc, buf)
        finally:
            with self.lock:
                self.active -= 1

    def reads(self, key_offset: int | None = None) -> int:
        with self.lock:
            return len(self.calls) if key_offset is None else sum(1 for c in self.calls if c[2] == key_offset)

    def wait_active(self, n: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.active >= n:
                    return
            time.sleep(0.002)
        raise AssertionError(f"{n} reads never ran at once (active {self.active})")


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)
