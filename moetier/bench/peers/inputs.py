"""What both systems serve, built once under data_dir/peers/models/ from ONE checkpoint:

  * the synth Hugging Face checkpoint (`moetier synth --preset olmoe-1b-7b --format hf`, seed 0,
    bf16), written to a temporary sibling and renamed into place;
  * per precision, moetier's container (`moetier convert`; resumable, its manifest last) and
    llama.cpp's GGUF: the sdist's convert_hf_to_gguf.py writes a bf16 GGUF (removed once the
    quantized ones exist) and llama.cpp's quantizer makes the Q4_0 / Q8_0 file from it.

Matched precision: `q4` is moetier int4 experts + int4 dense (one f16 scale per 64 inputs)
against pure Q4_0 (one f16 scale per 32); `q8` is int8 + int8 against pure Q8_0. Norms,
router gates and biases stay f32 on both sides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.bench.peers.peer import Peer
from moetier.convert.converter import ConvertOptions, convert
from moetier.errors import ResourceExhausted, Unavailable

PRESET = "olmoe-1b-7b"
SEED = 0
GROUP_SIZE = 64


@dataclass(frozen=True)
class Precision:
    name: str
    experts: str  # moetier's expert dtype
    dense: str  # moetier's dense dtype
    gguf_type: str  # llama.cpp's

    @property
    def options(self) -> ConvertOptions:
        return ConvertOptions(self.experts, self.dense, GROUP_SIZE)  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"moetier {self.experts} experts + {self.dense} dense (g{GROUP_SIZE}) vs llama.cpp {self.gguf_type}"


PRECISIONS: dict[str, Precision] = {
    "q4": Precision("q4", "int4", "int4", "Q4_0"),
    "q8": Precision("q8", "int8", "int8", "Q8_0"),
}


def models_dir(data_dir: Path) -> Path:
    return data_dir / "peers" / "models"


def hf_checkpoint(data_dir: Path, say: Callable[[str], None] = print) -> Path:
    from moetier.convert.synth import write_hf_checkpoint

    target = models_dir(data_dir) / f"{PRESET}-seed{SEED}-hf"
    if (target / "config.json").is_file():  # synth writes config.json last
        return target
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"building the synth checkpoint {PRESET} (bf16, seed {SEED}) in {target} (once)")
    try:
        write_hf_checkpoint(PRESET, tmp, SEED, dtype="bf16")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def container(data_dir: Path, hf: Path, p: Precision, say: Callable[[str], None] = print) -> Path:
    out = models_dir(data_dir) / f"{PRESET}-seed{SEED}-{p.experts}-{p.dense}-g{GROUP_SIZE}"
    if not (out / "moetier.json").is_file():
        say(f"converting for moetier ({p.experts} experts, {p.dense} dense): {out}")
    return convert(hf, out, p.options, progress=False)  # a finished conversion returns at once


def _peer_run(argv: list[str], log: Path, what: str) -> None:
    with open(log, "ab") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise Unavailable(f"{what} failed (exit code {r.returncode}; log {log}):\n{tail}")


# bytes of a GGUF per byte of the bf16 one: Q4_0 is 18 bytes per 32 weights, Q8_0 34 per 32
GGUF_SHARE = {"Q4_0": 18 / 64, "Q8_0": 34 / 64}


def _room(where: Path, need: int, what: str) -> None:
    """ResourceExhausted unless `where`'s file system has `need` bytes free (and 1 GiB more)."""
    free = shutil.disk_usage(where).free
    if free < need + 2**30:
        raise ResourceExhausted(f"{what} needs about {need / 1e9:.1f} GB in {where} (+1 GiB to spare), and "
                                f"{free / 1e9:.1f} GB is free: free some space, or set data_dir elsewhere")


def _write(final: Path, argv: Callable[[Path], list[str]], log: Path, what: str, need: int) -> None:
    """Run the peer script `argv(tmp)`, which writes `final`'s temporary sibling tmp, then rename
    it into place; a failed run leaves nothing behind (a partial bf16 GGUF is 2 bytes a weight)."""
    _room(final.parent, need, what)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        _peer_run(argv(tmp), log, what)
        tmp.rename(final)
    finally:
        tmp.unlink(missing_ok=True)


def gguf(data_dir: Path, hf: Path, peer: Peer, p: Precision, keep_bf16: bool = False,
         say: Callable[[str], None] = print) -> Path:
    """The GGUF of `p`, made by the peer's own converter and quantizer (once)."""
    root = models_dir(data_dir)
    stem = f"{PRESET}-seed{SEED}.llama-cpp-python-{peer.version}"
    out = root / f"{stem}.{p.gguf_type}.gguf"
    if out.is_file():
        return out
    log = root / f"{stem}.log"
    bf16 = root / f"{stem}.bf16.gguf"
    bf16_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))  # the checkpoint is bf16 too
    if not bf16.is_file():
        say(f"converting to GGUF with the sdist's convert_hf_to_gguf.py: {bf16}")
        _write(bf16, lambda tmp: peer.script("gguf_convert.py", str(peer.llama_cpp_dir), str(hf), "--outfile",
                                             str(tmp), "--outtype", "bf16"), log, "convert_hf_to_gguf.py", bf16_bytes)
    say(f"quantizing to {p.gguf_type} with llama.cpp's quantizer: {out}")
    _write(out, lambda tmp: peer.script("gguf_quantize.py", str(bf16), str(tmp), p.gguf_type), log,
           "llama_model_quantize", int(bf16_bytes * GGUF_SHARE[p.gguf_type]))
    return out


def drop_intermediate(data_dir: Path, peer: Peer, wanted: list[Precision]) -> None:
    """Remove the bf16 GGUF once every wanted quantized GGUF exists (it is 2 bytes a weight)."""
    root = models_dir(data_dir)
    stem = f"{PRESET}-seed{SEED}.llama-cpp-python-{peer.version}"
    if all((root / f"{stem}.{p.gguf_type}.gguf").is_file() for p in wanted):
        (root / f"{stem}.bf16.gguf").unlink(missing_ok=True)


def gguf_summary(path: Path) -> dict[str, Any]:
    """Bytes of a GGUF file and of its tensors by type (read with the header only)."""
    return {"path": str(path), "bytes": path.stat().st_size}


def container_summary(path: Path) -> dict[str, Any]:
    m = json.loads((path / "moetier.json").read_text())
    total = sum(int(f["size"]) for f in m.get("files", {}).values()) if isinstance(m.get("files"), dict) else None
    return {"path": str(path), "quantization": m.get("quantization"), "expert_bytes": m.get("expert_bytes"),
            "bytes": total}
