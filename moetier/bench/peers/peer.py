"""The peer: llama.cpp through llama-cpp-python, built from its sdist, in a venv of its own.

Nothing of llama.cpp is part of moetier: `install` fetches the sdist from PyPI at run time,
unpacks it under data_dir/peers/llama-cpp-python-<version>/src (its bundled llama.cpp
holds the GGUF converter, convert_hf_to_gguf.py, and gguf-py), and builds it into a venv
beside it with `CMAKE_ARGS=-DGGML_NATIVE=ON` (the CPU's own instruction set, as llama.cpp
users build it). The multimodal library (mtmd) is left out (`-DLLAVA_BUILD=OFF`): nothing
here uses it and it only lengthens the build. The same venv gets the converter's packages
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


def peer_root(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Path:
    return data_dir / "peers" / f"llama-cpp-python-{version}"


def find_peer(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Peer | None:
    """The installed peer, or None when `install` has not completed (its record is written last)."""
    root = peer_root(data_dir, version)
    if not (root / INSTALL_RECORD).is_file() or not (root / "venv" / "bin" / "python").exists():
        return None
    return Peer(root, version)


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
    say(f"  building llama.cpp (CMAKE_ARGS={CMAKE_ARGS}); this takes a while")
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
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
    record = {"version": got_version.strip(), "cmake_args": CMAKE_ARGS, "system_info": system_info.strip(),
              "seconds": {"venv": round(t_venv, 1), "fetch_sdist": round(t_fetch, 1), "build": round(t_build, 1),
                          "converter_packages": round(t_conv, 1)},
              "cpus": os.cpu_count()}
    (root / INSTALL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    say(f"  llama.cpp: {record['system_info']}")
    return Peer(root, version)


def require_peer(data_dir: Path, version: str = LLAMA_CPP_PYTHON) -> Peer:
    peer = find_peer(data_dir, version)
    if peer is None:
        raise InvalidArgument(f"llama-cpp-python {version} is not installed under {peer_root(data_dir, version)}; "
                              "run `moetier bench peers --install` first (it builds llama.cpp from source)")
    return peer
