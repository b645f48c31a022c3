"""A moetier process started by a launcher (`moetier up`, `moetier chaos`) dies with it.

    env = {**os.environ, **parent_env(os.getpid())}    # the launcher, for each child
    die_with_launcher()                                # the child, first thing (moetier.cli)

Kept apart from moetier.launch so that every command can call it without that module's imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "_MOETIER_DIE_WITH_PARENT"  # a launcher's pid, for `die_with_launcher` in its child


def parent_env(parent: int) -> dict[str, str]:
    """The environment entry asking a `moetier` child to die with `parent` (see
    `die_with_launcher`): for moetier's own services, which then need no `preexec_fn`.

    A preexec_fn runs Python in the child between fork and exec, after the fork handlers of a
    parent that has threads (gRPC channels, the kernel pool); Python documents it as unsafe
    there, and a chaos run once stayed blocked in Popen for 14 minutes starting its gateway.
    Without one, Popen forks without running anything of the parent in the child."""
    return {PARENT_ENV: str(parent)} if sys.platform.startswith("linux") else {}


def die_with_launcher() -> None:
    """First thing in a `moetier` process started with `parent_env`: get SIGTERM when that
    launcher dies (PR_SET_PDEATHSIG, as `die_with_parent` sets it), or exit now if it died
    before this ran (this process was handed to another parent). The entry is removed, so the
    process's own children do not inherit it."""
    value = os.environ.pop(PARENT_ENV, None)
    if value is None or not sys.platform.startswith("linux"):
        return
    try:
        parent = int(value)
    except ValueError:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
