"""A Hugging Face checkpoint as the converter reads it: config.json plus safetensors
(a single file or shards with model.safetensors.index.json). Pickle checkpoints are
refused, never unpickled. Every shard's header is validated before anything is written.

Tensors are read through np.memmap and widened to float32 here: BF16 (raw uint16 bit
patterns), F16, F32, F64, and FP8 E4M3 with DeepSeek-style 128x128 block scales
(`<name>_scale_inv`, decoded with a 256-entry lookup table: no ml_dtypes needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetier.convert.adapters import Adapter, AdapterError, adapter_for
from moetier.errors import ConversionError, FormatError
from moetier.model.config import ModelArgs
from moetier.weights.format import COPIED_FILES, canonical_json, xxh3_hex
from moetier.weights.quant import bf16_to_f32
from moetier.weights.safetensors_io import Header, MappedFile, TensorInfo, read_header

F32 = npt.NDArray[np.float32]
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128


def _e4m3_table() -> F32:
    """float32 value of every FP8 E4M3FN byte (1 sign, 4 exponent bits with bias 7, 3 mantissa bits)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3 = _e4m3_table()


@dataclass(frozen=True)
class Shard:
    name: str
    path: Path
    header: Header

    @property
    def size(self) -> int:
        return self.path.stat().st_size


class HFSource:
    def __init__(self, root: Path, config_path: Path, shards: list[Shard]) -> None:
        self.root = root
        self.config_path = config_path
        self.config_bytes = config_path.read_bytes()
        try:
            self.config: dict[str, Any] = json.loads(self.config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{config_path}: not valid JSON ({e})") from e
        try:
            self.adapter: Adapter = adapter_for(self.config.get("model_type"))
            self.args: ModelArgs = self.adapter.model_args(self.config)
        except (AdapterError, ValueError, TypeError, KeyError) as e:
            raise ConversionError(f"{config_path}: {e}") from e
        self.shards = shards

    @classmethod
    def open(cls, src: Path) -> HFSource:
        if not src.exists():
            raise ConversionError(f"{src}: no such file or directory")
        if src.is_file():
            if src.suffix in PICKLE_SUFFIXES:
                raise ConversionError(f"{src.name}: pickle checkpoints are refused; moetier reads safetensors only "
                                      "and never unpickles")
            if src.suffix != ".safetensors":
                raise ConversionError(f"{src}: not a safetensors file")
            return cls(src.parent, _config(src.parent), [_shard(src.parent, src.name)])
        root = src
        config = _config(root)
        index = root / INDEX_NAME
        if index.is_file():
            try:
                wm = json.loads(index.read_bytes())["weight_map"]
                names = sorted(set(wm.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConversionError(f"{INDEX_NAME}: malformed ({e!r})") from e
            for n in names:
                if "/" in n or n.startswith("."):
                    raise ConversionError(f"{INDEX_NAME}: shard name {n!r} points outside the checkpoint")
                if not (root / n).is_file():
                    raise ConversionError(f"shard {n} listed in {INDEX_NAME} is missing")
            shards = [_shard(root, n) for n in names]
            by_name = {s.name: s for s in shards}
            for tname, sname in wm.items():
                if tname not in by_name[sname].header.tensors:
                    raise ConversionError(f"tensor {tname!r} listed in {INDEX_NAME} is missing from shard {sname}")
            return cls(root, config, shards)
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if found:
            return cls(root, config, [_shard(root, n) for n in found])
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ConversionError(f"{pickles[0]}: pickle checkpoints are refused; moetier reads safetensors only "
                                  "and never unpickles")
        raise ConversionError(f"{root}: no safetensors weights (model.safetensors or {INDEX_NAME})")

    def identity(self) -> dict[str, Any]:
        """Cheap identity of the source: config bytes and every shard's size and header."""
        return {
            "config": xxh3_hex(self.config_bytes),
            "shards": [[s.name, s.size, xxh3_hex(s.header.header_bytes)] for s in self.shards],
        }

    def identity_hash(self) -> str:
        return xxh3_hex(canonical_json(self.identity()))

    def extra_files(self) -> dict[str, Path]:
        return {n: self.root / n for n in COPIED_FILES if (self.root / n).is_file()}


def _config(root: Path) -> Path:
    p = root / "config.json"
    if not p.is_file():
        raise ConversionError(f"{root}: no config.json")
    return p


def _shard(root: Path, name: str) -> Shard:
    try:
        return Shard(name, root / name, read_header(root / name, f"shard {name}"))
    except FormatError as e:
        raise ConversionError(str(e)) from e


def load_f32(mf: MappedFile, info: TensorInfo, shard: str) -> F32:
    """A source tensor widened to float32 (a copy; the map is only read)."""
    if info.dtype == "F8_E4M3":
        sname = info.name + SCALE_SUFFIX
        if sname not in mf.header.tensors:
            raise ConversionError(f"FP8 tensor {info.name!r} in {shard} has no {sname!r} in the same shard")
        return fp8_block_dequant(mf.raw(info.name), load_f32(mf, mf.header.tensors[sname], shard), info.name)
    return widen(mf.raw(info.name), info.dtype, info.name, shard)


def widen(raw: np.ndarray, tag: str, name: str, shard: str) -> F32:
    """Stored values (any slice of a mapped tensor) -> float32."""
    if tag == "F32":
        return np.array(raw, dtype=np.float32)
    if tag in ("F16", "F64"):
        return raw.astype(np.float32)
    if tag == "BF16":
        return bf16_to_f32(np.ascontiguousarray(raw))
    raise ConversionError(f"tensor {name!r} in {shard} has dtype {tag}, which moetier cannot convert "
                          "(supported: F32, BF16, F16, 2-D F8_E4M3 with 128x128 block scales)")


def fp8_block_dequant(q: np.ndarray, scale_inv: F32, name: str) -> F32:
    """FP8 E4M3 [R, C] times 128x128 block scales [ceil(R/128), ceil(C/128)] -> float32."""
    if q.ndim != 2:
        raise ConversionError(f"FP8 tensor {name!r} is {q.ndim}-D; only 2-D block-scaled FP8 is supported")
    r, c = q.shape
    want = (-(-r // FP8_BLOCK), -(-c // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ConversionError(f"FP8 tensor {name!r}: scale_inv shape {list(scale_inv.shape)}, expected {list(want)}")
    w = E4M3[np.asarray(q, dtype=np.uint8)]
    s = np.repeat(np.repeat(scale_inv, FP8_BLOCK, axis=0)[:r], FP8_BLOCK, axis=1)[:, :c]
    return (w * s).astype(np.float32)
