"""Background threads that must not slow the step.

A decode step keeps every core busy with the kernels' threads (moetier.kernels), so any other
thread that runs at the same time takes its CPU time from the step. Work that can wait -- the
prefix cache writing a finished sequence's KV to disk (up to hundreds of MiB: a checksum and a
copy into the page cache) -- runs on threads of the idle scheduling class (SCHED_IDLE, where
the system has it; else the lowest nice value, 19): they run only on a core nothing else wants,
and give it up the moment a thread of the step does. At nice 19 alone, the writer of a 1k-token
request's KV still took about a tenth of the CPU samples of the next request's decode on
`moetier up` (2 cores, olmoe-1b-7b): the kernels' helper threads yield while they wait for work,
and a yield hands the core to any runnable thread, however low its priority. Even in the idle
class the writer's copy still took memory bandwidth from the kernels, so the prefix cache also
holds its writes back while the dense worker steps (`PrefixCache.stepping`).

A background thread that holds the GIL while the step thread waits for it does not hold up the
step for long: the waiting thread leaves its core idle, and the background thread runs there.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 19


def lower_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Put the calling thread (only it: Linux schedules each thread on its own) in the idle
    scheduling class, at nice `nice`; a thread pool's initializer. False where the system allows
    neither (logged)."""
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, e)
        return False
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            log.debug("thread %s stays in its scheduling class (nice %d): %s", threading.current_thread().name,
                      nice, e)
    return True


def idle_class() -> bool:
    """Whether the calling thread is in the idle scheduling class."""
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(threading.get_native_id()) == os.SCHED_IDLE


def thread_nice() -> int:
    """The calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
