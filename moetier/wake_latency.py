"""Holding the CPUs' wake-up latency down while moetier computes (a Linux PM QoS request).

A decode step hands work between threads and processes many times: the dense worker sends
each MoE layer to the expert store over the local lane and waits, the store's thread wakes,
computes on its kernel threads and answers, the worker's thread wakes. When a CPU has nothing
to run it enters an idle state, and leaving a deep one costs time on every wake-up. On a
virtual machine whose idle vCPUs halt (cpuidle haltpoll with guest_halt_poll_ns = 0, as on
this project's 2-vCPU test machines) the wake-up goes through the hypervisor: a
condition-variable wake-up measured 20 us median but 0.42 ms at p90, against 0.02 ms at p90
with the latency held at 0. Through `moetier up` (olmoe-1b-7b int4, all experts resident,
Zen 4) that was 8.1-8.5 tok/s against 13.8-14.1 in the same minutes; at other times the host
wakes vCPUs quickly and the two are alike (12.0 and 12.2).

Writing a latency bound to /dev/cpu_dma_latency, and keeping the file open, asks the kernel
to use no idle state that takes longer to leave (0: idle CPUs poll instead of halting); the
request ends when the file is closed, at the latest when the process exits. It needs write
access to the device (root, normally); without it nothing is held and the service runs as
before. The cost is power: a polling CPU looks busy to the host.

    hold = hold_wake_latency(settings.kernels.max_wake_latency_us)   # None: leave it to the system
    ...
    hold.close()
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

log = logging.getLogger(__name__)

DEVICE = Path("/dev/cpu_dma_latency")


class WakeLatencyHold:
    """An open PM QoS request (or none: `held` is False); `close()` ends it."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WakeLatencyHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hold_wake_latency(max_us: int | None, device: Path = DEVICE) -> WakeLatencyHold:
    """Ask for CPUs that wake within `max_us` microseconds while the hold is open (None: ask
    nothing). A device that is absent or not writable holds nothing and says so in the log."""
    if max_us is None:
        return WakeLatencyHold(None)
    if max_us < 0:
        raise ValueError(f"max wake latency must be >= 0 microseconds, got {max_us}")
    fd = -1
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
        os.write(fd, struct.pack("=i", min(max_us, 2**31 - 1)))
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        log.info("CPU wake-up latency left to the system (%s: %s; kernels.max_wake_latency_us needs write "
                 "access to it)", device, e.strerror or e)
        return WakeLatencyHold(None)
    log.info("holding CPU wake-up latency at %d us while serving (%s; kernels.max_wake_latency_us: null leaves it "
             "to the system)", max_us, device)
    return WakeLatencyHold(fd)
