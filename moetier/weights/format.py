"""Constants of the container format (docs/internals.md, 'The container') and the small
helpers every writer and reader shares: checksums, canonical JSON, atomic writes."""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "moetier-container"
FORMAT_VERSION = 1
CHECKSUM = "xxh3_64"

MANIFEST = "moetier.json"
INDEX = "experts/index.json"
DENSE_DIR = "dense"
EXPERTS_DIR = "experts"
MTP_DIR = "mtp"  # the multi-token-prediction head: its dense files and mtp/experts/ (own index)
MTP_EXPERTS_DIR = "mtp/experts"
MTP_INDEX = "mtp/experts/index.json"
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")

RECORD_ALIGN = 4096  # records start on and are padded to this boundary (O_DIRECT)
PART_ALIGN = 64  # each part of a record starts on this boundary inside the record

# manifest keys: required and optional
MANIFEST_KEYS = {"format", "format_version", "model", "quantization", "source", "files", "expert_bytes",
                 "created_by"}
MANIFEST_OPTIONAL = {"quant_error", "mtp"}
MTP_KEYS = {"layers", "dtype", "group_size", "hidden_first"}
MTP_OPTIONAL = {"quant_error"}
QUANT_KEYS = {"experts", "dense", "group_size"}
INDEX_KEYS = {"format_version", "checksum", "layout", "files", "moe_layers", "n_experts", "records", "identity"}
SAFETENSORS_META_KEY = "moetier"


def dense_file_name(k: int) -> str:
    return f"{DENSE_DIR}/model-{k:05d}.safetensors"


def mtp_dense_file_name(k: int) -> str:
    return f"{MTP_DIR}/model-{k:05d}.safetensors"


def expert_file_name(layer: int) -> str:
    return f"layer-{layer:03d}.bin"


def xxh3_hex(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def xxh3_file(path: Path, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The bytes identities are computed over: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def atomic_write(path: Path, data: bytes) -> None:
    """tmp + fsync + rename: readers see the old file or the whole new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_bytes(obj: Any) -> bytes:
    """Human-readable, deterministic JSON for files the container ships."""
    return (json.dumps(obj, indent=1) + "\n").encode()


def created_by() -> str:
    try:
        return f"moetier {metadata.version('moetier')}"
    except metadata.PackageNotFoundError:
        return "moetier"
