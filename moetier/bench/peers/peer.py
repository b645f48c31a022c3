"""The peer: llama.cpp through llama-cpp-python, built from its sdist, in a venv of its own.

Nothing of llama.cpp is part of moetier: `install` fetches the sdist from PyPI at run time,
unpacks it under data_dir/peers/llama-cpp-python-<version>/src (its bundled llama.cpp
holds the GGUF converter, convert_hf_to_gguf.py, and gguf-py), and builds it into a venv
beside it with `CMAKE_ARGS=-DGGML_NATIVE=ON` (the CPU's own instruction set, as llama.cpp
users build it), AMX left out where the CPU has it (`build_cflags`). The multimodal library
(mtmd) is left out (`-DLLAVA_BUILD=OFF`): nothing here uses it and it only lengthens the build. The same venv gets the converter's packages
(torch, transformers, sentencepiece). install.json records what was built, how long it
took and llama.cpp's own system_info line.

The venv's interpreter runs three small scripts of this package (they import nothing of
moetier): llama_server.py (llama_cpp.server, optionally without the CPU repack),
gguf_convert.py (the converter, with a pre-tokenizer fallback) and gguf_quantize.py
(llama.cpp's quantizer through the binding's llama_model_quantize).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.errors import InvalidArgument, Unavailable

LLAMA_CPP_PYTHON = "0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
# what the converter script imports beyond gguf-py (bundled in the sdist) and numpy
CONVERTER_PACKAGES = ("torch==2.13.0", "transformers>=4.57", "sentencepiece", "safetensors", "tqdm", "pyyaml",
                      "requests")
# llama.cpp's AMX matmul (ggml-cpu/amx, compiled in by -march=native where the CPU has AMX) died
# with SIGILL on `tilezero` in a worker thread, serving the OLMoE Q4_0 GGUF on a 2-vCPU Intel Xeon
# VM (amx_tile amx_int8 amx_bf16), while AMX instructions run there in any thread of a
# process that requested the permission. It holds only the dense matrices (the expert tensors
# go to the CPU repack), so the peer is built without it; GCC lets -mno-* win over -march.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SCRIPTS = Path(__file__).resolve().parent
INSTALL_RECORD = "install.json"


@dataclass(frozen=True)
class Peer:
    """An installed llama-cpp-python: its venv's interpreter and the unpacked sdist."""

    root: Path  # data_dir/peers/llama-cpp-python-<version>
    version: str

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def llama_cpp_dir(self) -> Path:
        """The llama.cpp source tree the sdist bundles (converter, gguf-py)."""
        return self.root / "src" / "vendor" / "llama.cpp"

    @property
    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = json.loads((self.root / INSTALL_RECORD).read_text())
        return rec

    def script(self, name: str, *args: str) -> list[str]:
        """argv running one of this package's peer-side scripts with the peer's interpreter."""
        return [str(self.python), str(SCRIPTS / name), *args]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_cflags(machine: str | None = None, cpu_flags: set[str] | None = None) -> str:
    """CFLAGS and CXXFLAGS of the peer's build beside CMAKE_ARGS: NO_AMX_CFLAGS on an x86-64 CPU
    with AMX, else nothing."""
    machine = machine or platform.machine()
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return NO_AMX_CFLAGS if machine in ("x86_64", "AMD64") and "amx_tile" in flags else ""


def peer_root(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Path:
    return data_dir / "peers" / f"llama-cpp-python-{version}"


def _recorded_cflags(root: Path) -> str | None:
    """The compiler flags the complete install under `root` was built with ("" where its record
    predates them); None without a complete install (its record is written last)."""
    if not (root / "venv" / "bin" / "python").exists():
        return None
    try:
        return str(json.loads((root / INSTALL_RECORD).read_text()).get("cflags", ""))
    except (OSError, ValueError):
        return None


def find_peer(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Peer | None:
    """The installed peer, or None when `install` has not completed or built it with other
    compiler flags than `build_cflags` gives on this machine."""
    root = peer_root(data_dir, version)
    return Peer(root, version) if _recorded_cflags(root) == build_cflags() else None


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    """Run a build step, its output appended to `log`; seconds taken. Unavailable on failure."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(argv) + "\n").encode())
        f.flush()
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False)
    if r.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise Unavailable(f"`{' '.join(argv[:4])} ...` failed with exit code {r.returncode} "
                          f"(full log: {log}):\n{tail}")
    return time.perf_counter() - t0


def install(data_dir: Path, version: str = LLAMA_CPP_PYTHON, *, say: Any = print) -> Peer:
    """Build llama-cpp-python `version` from its sdist into data_dir/peers (once; a rerun after
    a failure starts over). Returns the peer; install.json holds the build time."""
    found = find_peer(data_dir, version)
    if found is not None:
        return found
    root = peer_root(data_dir, version)
    if root.exists():
        shutil.rmtree(root)  # an interrupted or failed install
    root.mkdir(parents=True)
    log = root / "install.log"
    venv = root / "venv"
    say(f"installing llama-cpp-python {version} from its sdist into {root} (log: {log})")
    t_venv = _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        t_fetch = _run([*pip, "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={version}",
                        "-d", tmp], log)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        shutil.move(str(Path(tmp) / sdist.name.removesuffix(".tar.gz")), root / "src")
    cflags = build_cflags()
    say(f"  building llama.cpp (CMAKE_ARGS={CMAKE_ARGS}{f', CFLAGS={cflags}' if cflags else ''}); this takes a while")
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    if cflags:
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = f"{env.get(var, '')} {cflags}".strip()
    t_build = _run([*pip, "install", "--no-cache-dir", f"{root / 'src'}[server]"], log, env=env)
    say(f"  built in {t_build:.0f} s; installing the GGUF converter's packages")
    t_conv = _run([*pip, "install", *CONVERTER_PACKAGES], log)
    info = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import llama_cpp; print(llama_cpp.__version__); "
                           "print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, check=False)
    if info.returncode != 0:
        raise Unavailable(f"the built llama_cpp does not import:\n{info.stderr[-2000:]}")
    got_version, system_info = [*info.stdout.splitlines(), "", ""][:2]
    record = {"version": got_version.strip(), "cmake_args": CMAKE_ARGS, "cflags": cflags,
              "system_info": system_info.strip(),
              "seconds": {"venv": round(t_venv, 1), "fetch_sdist": round(t_fetch, 1), "build": round(t_build, 1),
                          "converter_packages": round(t_conv, 1)},
              "cpus": os.cpu_count()}
    (root / INSTALL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    say(f"  llama.cpp: {record['system_info']}")
    return Peer(root, version)


def require_peer(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Peer:
    root = peer_root(data_dir, version)
    built_with, needed = _recorded_cflags(root), build_cflags()
    if built_with == needed:
        return Peer(root, version)
    if built_with is not None:
        raise InvalidArgument(f"llama-cpp-python {version} under {root} was built with other compiler flags "
                              f"than this machine needs (CFLAGS {needed or 'none'!r}); run `moetier "
                              "bench peers --install` to rebuild it")
    raise InvalidArgument(f"llama-cpp-python {version} is not installed under {root}; "
                          "run `moetier bench peers --install` first (it builds llama.cpp from source)")
