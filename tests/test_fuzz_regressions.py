"""One regression test per bug the fuzzers (tests/test_fuzz_*.py, scripts/fuzz.py) found: each
input below once raised something other than moetier's own error (a crash of the reader,
the worker's start-up or the servicer), or allocated what a length field declared."""

from __future__ import annotations

import io
import json
import shutil
import struct
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from test_container import build
from test_dense_worker_prefix import IDENTITY, MID, ids_of, kv_of

from moetier.convert.synth import preset_args
from moetier.errors import FormatError, InvalidArgument
from moetier.prefix_cache import PrefixCache
from moetier.rpc.tensors import from_pb
from moetier.rpc.v1 import tensor_pb2
from moetier.store.history import MAGIC as HIST_MAGIC
from moetier.store.history import load_history
from moetier.weights import Container
from moetier.weights.format import INDEX, MANIFEST, json_bytes
from moetier.weights.index import ExpertIndex, index_identity
from moetier.weights.layout import RecordLayout
from moetier.weights.safetensors_io import MappedFile, read_header


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("reg") / "c")


@pytest.fixture
def good(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "c"))


def _edit(path: Path, fn: Any) -> None:
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_bytes(json_bytes(doc))


def _edit_index(good: Path, fn: Any) -> None:
    """Edit experts/index.json, keeping its identity and the manifest's size of it right."""
    def edit(d: dict[str, Any]) -> None:
        fn(d)
        d["identity"] = index_identity(d["layout"], d["files"], d["records"])

    _edit(good / INDEX, edit)
    _edit(good / MANIFEST, lambda m: m["files"][INDEX].update(size=(good / INDEX).stat().st_size))


@pytest.mark.parametrize("value", ["", None, 1.5, [1]])
def test_manifest_expert_bytes_not_an_integer(good: Path, value: Any) -> None:
    _edit(good / MANIFEST, lambda m: m.update(expert_bytes=value))
    with pytest.raises(FormatError, match="expert_bytes: expected an integer"):
        Container.open(good)


@pytest.mark.parametrize("model", [None, [], "x"])
def test_manifest_model_not_an_object(good: Path, model: Any) -> None:
    _edit(good / MANIFEST, lambda m: m.update(model=model))
    with pytest.raises(FormatError, match=r"moetier\.json: model"):
        Container.open(good)


@pytest.mark.parametrize("at, value, match", [(3, "4096", "malformed record"), (1, None, "malformed record"),
                                              (2, -1, "malformed record"), (3, -4096, "not 4096-aligned")])
def test_index_record_fields_of_the_wrong_type_or_sign(good: Path, at: int, value: Any, match: str) -> None:
    _edit_index(good, lambda d: d["records"][0].__setitem__(at, value))
    with pytest.raises(FormatError, match=match):
        Container.open(good)


def test_index_counts_not_integers(good: Path) -> None:
    _edit_index(good, lambda d: d.update(n_experts="4"))
    with pytest.raises(FormatError, match="n_experts must be a positive integer"):
        Container.open(good)
    _edit_index(good, lambda d: d.update(n_experts=4, moe_layers=5))
    with pytest.raises(FormatError, match="moe_layers must be ascending"):
        Container.open(good)


def test_record_layout_of_an_unknown_dtype(good: Path) -> None:
    layout = json.loads((good / INDEX).read_bytes())["layout"]
    for p in layout["parts"]:
        p["dtype"] = "int3"
    with pytest.raises(FormatError, match="record layout 'int3'"):
        RecordLayout.from_dict(layout)


def test_json_nested_too_deep(good: Path) -> None:
    (good / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError, match=r"moetier\.json: not valid JSON"):
        Container.open(good)


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,  # nesting past the recursion limit
                                 b'{"format_version": ' + b"7" * 5000 + b"}",  # an int past Python's digit limit
                                 b"\xff\xfe{}"])  # not UTF-8
def test_a_hostile_expert_index_is_a_format_error(good: Path, raw: bytes) -> None:
    (good / INDEX).write_bytes(raw)
    with pytest.raises(FormatError, match=r"index\.json: not valid JSON"):
        ExpertIndex.load(good)


def _safetensors(path: Path, header: dict[str, Any], data: int = 0) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4], [-2, -2], [2.5, 2], ["2", 2]])
def test_safetensors_shape_that_overflows_or_is_not_natural(tmp_path: Path, shape: list[Any]) -> None:
    """int64 products wrapped to a size that fit the data (0 or 4 bytes); negative or non-integer
    dimensions were taken; the view then failed deep inside numpy."""
    path = _safetensors(tmp_path / "x.safetensors", {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(FormatError, match="tensor 't'"):
        MappedFile(path)


def test_safetensors_too_many_dimensions(tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "x.safetensors", {"t": {"dtype": "U8", "shape": [1] * 70,
                                                           "data_offsets": [0, 1]}}, 1)
    with pytest.raises(FormatError, match="70 dimensions"):
        read_header(path)


def test_safetensors_metadata_not_an_object(tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "x.safetensors", {"__metadata__": ["x"]})
    with pytest.raises(FormatError, match="__metadata__ is not a JSON object"):
        read_header(path)


def _dense_with_meta(good: Path, meta: Any) -> None:
    rel = sorted(p for p in (good / "dense").iterdir())[0]
    raw = rel.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    compact = (",", ":")
    header["__metadata__"]["moetier"] = json.dumps(meta(json.loads(header["__metadata__"]["moetier"])),
                                                   separators=compact)
    new = json.dumps(header, separators=compact).encode()
    assert len(new) <= n
    rel.write_bytes(struct.pack("<Q", n) + new + b" " * (n - len(new)) + raw[8 + n:])


def test_dense_metadata_group_size_zero(good: Path) -> None:
    """An int8 tensor with group size 0 divided by zero while its entries were listed."""
    def zero(meta: dict[str, Any]) -> dict[str, Any]:
        name = next(k for k, v in meta.items() if v["dtype"] == "int8")
        meta[name]["group_size"] = 0
        return meta

    _dense_with_meta(good, zero)
    with pytest.raises(FormatError, match="group size 0 is not a valid dense tensor"):
        Container.open(good)


def test_dense_metadata_not_an_object(good: Path) -> None:
    _dense_with_meta(good, lambda meta: list(meta))
    with pytest.raises(FormatError, match="malformed 'moetier' metadata"):
        Container.open(good)


def test_container_file_behind_a_symlink_out_of_it(good: Path, tmp_path: Path) -> None:
    """A listed file that is a symlink to a file outside the container is refused."""
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((good / "config.json").read_bytes())
    (good / "config.json").unlink()
    (good / "config.json").symlink_to(outside)
    with pytest.raises(FormatError, match=r"'config\.json' is outside the container"):
        Container.open(good)


# ---- usage history -----------------------------------------------------------------------------
def _hist(path: Path, payload: bytes) -> Path:
    path.write_bytes(struct.pack("<8sQQ", HIST_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
    return path


def _npy(descr: str, shape: tuple[int, ...], data: bytes) -> bytes:
    head = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    head += b" " * (-(10 + len(head) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head + data


def test_history_member_declaring_a_huge_array(tmp_path: Path) -> None:
    """np.load allocated the 8 GiB a .npy header declared before finding 0 bytes behind it."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("identity.npy", _npy("<U5", (), b"i\0\0\0" * 5))
        z.writestr("layers.npy", _npy("<i4", (3,), bytes(12)))
        z.writestr("counts.npy", _npy("<f4", (2**31,), b""))
    path = _hist(tmp_path / "h.hist", buf.getvalue())
    tracemalloc.start()
    try:
        assert load_history(path, [1, 2, 3], 8, "ident") is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize("payload", [_npy("<f4", (2,), bytes(8)), b"\x80\x04N.", b"{}"])
def test_history_payload_that_is_not_an_archive(tmp_path: Path, payload: bytes) -> None:
    """A bare .npy payload (valid checksum) made `with np.load(...)` raise TypeError."""
    assert load_history(_hist(tmp_path / "h.hist", payload), [1, 2, 3], 8, "ident") is None


def test_history_arrays_of_the_wrong_kind(tmp_path: Path) -> None:
    """2-D layers made the list comparison ambiguous; string counts broke isfinite."""
    for arrays in ({"identity": np.array("ident"), "layers": np.ones((3, 2), np.int32),
                    "counts": np.ones((3, 8), np.float32)},
                   {"identity": np.array("ident"), "layers": np.array([1, 2, 3], np.int32),
                    "counts": np.full((3, 8), "a")}):
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        assert load_history(_hist(tmp_path / "h.hist", buf.getvalue()), [1, 2, 3], 8, "ident") is None


# ---- prefix cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("hashes", ["-1"]), ("hashes", ["1" * 40]), ("tokens", float("inf")),
                                          ("offset", float("inf"))])
def test_prefix_cache_file_with_an_overflowing_number(tmp_path: Path, field: str, value: Any) -> None:
    """OverflowError (a hash outside 64 bits, an infinite count) escaped the scan: the dense worker
    did not start. Now the file is rejected and removed."""
    args = preset_args("tiny-mixtral")
    ids = ids_of(40, 1)
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    a.insert(kv_of(args, ids))
    a.close()
    (f,) = tmp_path.iterdir()
    raw = f.read_bytes()
    _, hlen, plen, _ = struct.unpack_from("<8sQQQ", raw)
    header = json.loads(raw[32:32 + hlen].rstrip(b"\0"))
    if field == "offset":
        header["arrays"][0]["offset"] = value
    else:
        header[field] = value
    new = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    new += b"\0" * (-(32 + len(new)) % 64)
    payload = raw[32 + hlen:]
    f.write_bytes(struct.pack("<8sQQQ", b"MTPFXKV1", len(new), plen,
                              xxhash.xxh3_64_intdigest(new + payload)) + new + payload)
    b = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    assert b.stats().entries == 0 and b.stats().files_rejected == 1 and not f.exists()
    b.close()


# ---- proto tensors -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[2**32, 2**32], [0, 2**62, 2**62], [2**62, 4]])
def test_tensor_shape_whose_product_overflows(shape: list[int]) -> None:
    """np.prod wrapped past int64 to 0 bytes, which the empty data matched; reshape then raised ValueError."""
    with pytest.raises(InvalidArgument, match="hidden: shape"):
        from_pb(tensor_pb2.Tensor(dtype="float32", shape=shape, data=b""), "hidden")


def test_tensor_with_too_many_dimensions() -> None:
    with pytest.raises(InvalidArgument, match="hidden: 70-D tensor"):
        from_pb(tensor_pb2.Tensor(dtype="uint8", shape=[1] * 70, data=b"x"), "hidden")
