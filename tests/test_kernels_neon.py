"""Every C kernel path against every other, on two machines: the x86 build's paths here
and the aarch64 build's (portable and NEON) under qemu-user. tests/kernels_driver.c runs
every kernel on fixed inputs with every path its CPU supports and prints a hash of each
output's bits; all of them must agree, case by case.

The NEON kernels run twice, on qemu's default CPU (with the dot-product extension) and as a
Cortex-A53 (without). Needs Debian's gcc-aarch64-linux-gnu and qemu-user (.ci/run installs
them); skips with a reason where they are missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from moetier.kernels import fast

ROOT = Path(__file__).resolve().parent.parent
CSRC = Path(fast.__file__).with_name("csrc")
FLAGS = ["-O2", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-pthread", f"-I{CSRC}"]
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")


def build(cc: str, out: Path) -> None:
    sources = [str(ROOT / "tests" / "kernels_driver.c"), *sorted(str(p) for p in CSRC.glob("*.c")
                                                                 if p.name != "module.c")]
    subprocess.run([cc, *FLAGS, *sources, "-o", str(out), "-lm"], check=True, capture_output=True, text=True)


def hashes(cmd: list[str], machine: str, env: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600,
                         env=None if env is None else {**os.environ, **env}).stdout
    got: dict[str, dict[str, str]] = defaultdict(dict)
    for line in out.splitlines():
        case, path, digest = line.split()
        got[case][f"{machine}/{path}"] = digest
    return got


def test_neon_and_x86_paths_give_the_portable_bits(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not cc:
        pytest.skip("no C compiler")
    if not cross or not qemu or not AARCH64_SYSROOT.is_dir():
        pytest.skip("needs Debian's gcc-aarch64-linux-gnu and qemu-user (apt-get install gcc-aarch64-linux-gnu "
                    "qemu-user) to run the NEON kernels")
    build(cc, tmp_path / "driver-native")
    build(cross, tmp_path / "driver-aarch64")
    native = hashes([str(tmp_path / "driver-native")], "native")
    run_arm = [qemu, "-L", str(AARCH64_SYSROOT), str(tmp_path / "driver-aarch64")]
    # qemu's default CPU ("max") has the dot-product extension (the int8-activation kernel takes
    # SDOT); a Cortex-A53 has not (it takes the generic loop): both must give the same bits
    arm = hashes(run_arm, "aarch64")
    for case, digests in hashes(run_arm, "aarch64-a53", {"QEMU_CPU": "cortex-a53"}).items():
        arm[case].update(digests)
    assert native.keys() == arm.keys() and len(arm) > 400
    paths = {p for v in arm.values() for p in v}
    assert {"aarch64/neon", "aarch64-a53/neon", "aarch64/portable", "native/portable"} <= paths | set(
        next(iter(native.values())))
    differ = []
    for case in native:
        both = {**native[case], **arm[case]}
        if len(set(both.values())) != 1:
            differ.append((case, both))
    assert not differ, f"{len(differ)} of {len(native)} cases differ between paths, e.g. {differ[:3]}"
