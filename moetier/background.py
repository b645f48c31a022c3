"""Background threads that must not slow the step.

A decode step keeps every core busy with the kernels' threads (moetier.kernels), so any other
thread that runs at the same time takes its CPU time from the step. Work that can wait -- the
prefix cache writing a finished sequence's KV to disk (up to hundreds of MiB: a checksum and a
copy into the page cache) -- runs on threads at the lowest CPU priority (nice 19): they get the
cores the step leaves idle, and almost none while it runs. Measured on `moetier up`, 2 cores,
olmoe-1b-7b: a decode right after a 1k-token request ran at 41 tok/s while that request's KV was
being written, 45 once it was written.

A low-priority thread that holds the GIL while the step thread waits for it does not hold up the
step for long: the waiting thread leaves its core idle, and the background thread runs there.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 19


def lower_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Give the calling thread (only it: Linux keeps a nice value per thread) the CPU priority
    `nice`; a thread pool's initializer. False where the system does not allow it (logged)."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, e)
        return False
    return True


def thread_nice() -> int:
    """The calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
