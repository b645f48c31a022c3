"""The PM QoS hold on the CPUs' wake-up latency (moetier/wake_latency.py), on a stand-in file:
the request is the 32-bit bound written once, held while the file is open."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest

from moetier.errors import InvalidArgument
from moetier.settings import load_settings
from moetier.wake_latency import hold_wake_latency


def _open_fds_to(path: Path) -> int:
    return sum(1 for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc (Linux)")
def test_a_hold_writes_the_bound_once_and_keeps_the_device_open_until_closed(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    with hold_wake_latency(7, dev) as hold:
        assert hold.held
        assert struct.unpack("=i", dev.read_bytes()) == (7,)
        assert _open_fds_to(dev) == 1  # the request lasts as long as the file is open
    assert not hold.held
    assert _open_fds_to(dev) == 0
    hold.close()  # closing twice is harmless


def test_none_asks_nothing_and_a_missing_device_holds_nothing_but_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    hold = hold_wake_latency(None, dev)
    assert not hold.held and dev.read_bytes() == b""
    with caplog.at_level(logging.INFO, logger="moetier.wake_latency"):
        hold = hold_wake_latency(0, tmp_path / "absent")
    assert not hold.held
    assert "left to the system" in caplog.text and "absent" in caplog.text
    with pytest.raises(ValueError, match="max wake latency"):
        hold_wake_latency(-1, dev)


def test_the_setting_defaults_to_0_and_refuses_negative() -> None:
    assert load_settings(environ={}).kernels.max_wake_latency_us == 0
    off = load_settings(overrides={"kernels": {"max_wake_latency_us": None}}, environ={})
    assert off.kernels.max_wake_latency_us is None
    with pytest.raises(InvalidArgument, match=r"kernels\.max_wake_latency_us"):
        load_settings(environ={"MOETIER_KERNELS__MAX_WAKE_LATENCY_US": "-3"})
