"""A child process dies with the process that started it, however that one dies (a SIGKILL runs
no handler of ours): PR_SET_PDEATHSIG, Linux only.

    env = {**os.environ, **parent_env(os.getpid())}    # a launcher, for each moetier child
    die_with_launcher()                                # the child, first thing (moetier.cli)
    Popen(argv, preexec_fn=die_with_parent(os.getpid()))   # any other program (llama.cpp's server)

The kernel sends the signal when the *thread* that forked the child ends: launchers start their
children from their main thread, which lives as long as the process.

Kept apart from moetier.launch so that every command can call it without that module's imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "_MOETIER_DIE_WITH_PARENT"  # a launcher's pid, for `die_with_launcher` in its child


def _bind(prctl: Callable[..., int], parent: int) -> None:
    """SIGTERM to this process when `parent` ends; exit now if it already has (this process was
    handed to another parent before the request, so no signal would ever come)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A `preexec_fn` binding the child to `parent` before it execs; None off Linux. For
    programs that are not moetier's (moetier's own services use `parent_env`)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def preexec() -> None:
        # Runs in the child between fork and exec, still with the parent's Python signal handlers:
        # a SIGTERM caught by one of those would be lost, so the default (terminate) comes first.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _bind(prctl, parent)

    return preexec


def parent_env(parent: int) -> dict[str, str]:
    """The environment entry asking a `moetier` child to die with `parent` (see
    `die_with_launcher`): for moetier's own services, which then need no `preexec_fn`.

    A preexec_fn runs Python in the child between fork and exec, after the fork handlers of a
    parent that has threads (gRPC channels, the kernel pool); Python documents it as unsafe
    there, and a chaos run once stayed blocked in Popen for 14 minutes starting its gateway.
    Without one, Popen forks without running anything of the parent in the child."""
    return {PARENT_ENV: str(parent)} if sys.platform.startswith("linux") else {}


def die_with_launcher() -> None:
    """First thing in a `moetier` process started with `parent_env`: bound to that launcher as
    `die_with_parent` binds a child. The entry is removed, so this process's own children do not
    inherit it."""
    value = os.environ.pop(PARENT_ENV, None)
    if value is None or not sys.platform.startswith("linux"):
        return
    try:
        parent = int(value)
    except ValueError:
        return
    _bind(ctypes.CDLL(None, use_errno=True).prctl, parent)
