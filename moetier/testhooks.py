"""Test-only fault hooks for `moetier chaos` (docs/reliability.md), off unless a `test_*` setting
names their file. Each reads one number from a file, re-read at most once a second, so a running
service is slowed down or has its clock moved by rewriting the file, with no restart:

- `ReadDelay` (`storage.test_read_delay_file`): seconds the expert store's I/O engine sleeps
  before each record read (a slow disk);
- `OffsetClock` (`test_clock_offset_file`): seconds added to the router's heartbeat clock (a
  clock that jumps, forward or back, under the registry's expiry).

A missing, empty or invalid file, or a value outside the hook's range, reads as 0."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path


class FileValue:
    def __init__(self, path: Path, low: float, high: float, recheck_s: float = 1.0) -> None:
        self.path = path
        self.low, self.high = low, high
        self.recheck_s = recheck_s
        self._value = 0.0
        self._checked = -math.inf
        self._lock = threading.Lock()

    def __call__(self) -> float:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= self.recheck_s:
                self._checked = now
                try:
                    value = float(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    value = 0.0
                self._value = value if math.isfinite(value) and self.low <= value <= self.high else 0.0
            return self._value


class ReadDelay(FileValue):
    def __init__(self, path: Path, recheck_s: float = 1.0) -> None:
        super().__init__(path, 0.0, 10.0, recheck_s)


class OffsetClock:
    """time.monotonic() plus the file's offset (at most a day either way)."""

    def __init__(self, path: Path, recheck_s: float = 1.0) -> None:
        self.offset = FileValue(path, -86400.0, 86400.0, recheck_s)

    def __call__(self) -> float:
        return time.monotonic() + self.offset()
