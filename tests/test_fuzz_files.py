"""Property-based fuzzing of the two files moetier persists and reads back at start: the prefix
cache's KV files (moetier/prefix_cache.py) and the learned policy's usage history
(moetier/store/history.py). A file that is torn, corrupt, of another model or crafted with a
valid checksum is ignored (and, for the prefix cache, removed); it never raises, never
allocates what a length field declares, and never gives KV bits other than those written."""

from __future__ import annotations

import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from helpers_fuzz import JSON_VALUES, TIMEOUT_S, clean, flip_bytes, fuzz_settings, mutate, seeded
from hypothesis import given
from hypothesis import strategies as st
from test_dense_worker_prefix import IDENTITY, MID, ids_of, kv_of

from moetier.convert.synth import preset_args
from moetier.model.config import ModelArgs
from moetier.model.kv_cache import KVCache
from moetier.prefix_cache import PrefixCache
from moetier.store.history import MAGIC as HIST_MAGIC
from moetier.store.history import load_history, save_history

pytestmark = pytest.mark.timeout(TIMEOUT_S)

_PRE = struct.Struct("<8sQQQ")


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return preset_args("tiny-mixtral")


@pytest.fixture(scope="module")
def kv_file(args: ModelArgs, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes, list[int], KVCache]:
    """One valid prefix-cache file (name, bytes), its tokens and the KV written."""
    d = tmp_path_factory.mktemp("kv")
    ids = ids_of(40, 1)
    kv = kv_of(args, ids)
    cache = PrefixCache(args, MID, IDENTITY, d, 1 << 30)
    cache.insert(kv)
    cache.close()
    (f,) = d.iterdir()
    return f.name, f.read_bytes(), ids, kv


def _split(raw: bytes) -> tuple[bytes, bytes, bytes]:
    _, hlen, _, _ = _PRE.unpack_from(raw)
    return raw[:_PRE.size], raw[_PRE.size:_PRE.size + hlen], raw[_PRE.size + hlen:]


def _repack(header: Any, payload: bytes) -> bytes:
    """A file with this header and payload whose lengths and checksum are right."""
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b"\0" * (-(_PRE.size + len(raw)) % 64)
    h = xxhash.xxh3_64()
    h.update(raw)
    h.update(payload)
    return _PRE.pack(b"MTPFXKV1", len(raw), len(payload), h.intdigest()) + raw + payload


def _serve(args: ModelArgs, name: str, blob: bytes, ids: list[int], kv: KVCache, compare: bool = True) -> None:
    """Start a cache over a directory holding `blob`, look the tokens up: a hit must give the bits written."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / name).write_bytes(blob)
        cache = PrefixCache(args, MID, IDENTITY, d, 1 << 30)
        try:
            got, n = cache.lookup([*ids, 7])
            if n and compare:
                assert got is not None
                want = kv.to_arrays()
                for key, arr in got.to_arrays().items():
                    np.testing.assert_array_equal(arr, want[key][:n], err_msg=key)
            if cache.stats().files_rejected:
                assert not (d / name).exists(), "a rejected file was left in place"
        finally:
            cache.close()


@seeded
@fuzz_settings(150)
@given(data=st.data())
def test_fuzz_prefix_cache_header(args: ModelArgs, kv_file: tuple[str, bytes, list[int], KVCache],
                                  data: st.DataObject) -> None:
    """Mutated headers with valid lengths and checksum: what a writer with a bug could leave."""
    name, raw, ids, kv = kv_file
    _, header, payload = _split(raw)
    doc = mutate(json.loads(header.rstrip(b"\0")), data)
    flipped = data.draw(st.booleans(), label="payload")
    if flipped:  # a checksum over changed KV bits vouches for them: only the outcome is checked then
        payload = flip_bytes(payload, data)
    blob = _repack(doc, payload)
    clean(lambda: _serve(args, name, blob, ids, kv, compare=not flipped), ())


HASHES = st.lists(st.one_of(st.sampled_from(["-1", "1" * 17, "1" * 40, "0x10", "", "zz"]),
                            st.text("0123456789abcdef", max_size=18)), max_size=3)


@seeded
@fuzz_settings(120)
@given(data=st.data())
def test_fuzz_prefix_cache_fields(args: ModelArgs, kv_file: tuple[str, bytes, list[int], KVCache],
                                  data: st.DataObject) -> None:
    """One header field (or one field of one array spec) set to any JSON value, checksum right."""
    name, raw, ids, kv = kv_file
    _, header, payload = _split(raw)
    doc = json.loads(header.rstrip(b"\0"))
    key = data.draw(st.sampled_from(sorted(doc)), label="field")
    value = data.draw(HASHES if key == "hashes" else JSON_VALUES, label="value")
    if key == "arrays":
        spec = doc["arrays"][data.draw(st.integers(0, len(doc["arrays"]) - 1), label="array")]
        spec[data.draw(st.sampled_from(sorted(spec)), label="spec field")] = value
    else:
        doc[key] = value
    blob = _repack(doc, payload)
    clean(lambda: _serve(args, name, blob, ids, kv), ())


@seeded
@fuzz_settings(100)
@given(data=st.data())
def test_fuzz_prefix_cache_bytes(args: ModelArgs, kv_file: tuple[str, bytes, list[int], KVCache],
                                 data: st.DataObject) -> None:
    """Torn, truncated and bit-flipped files (the checksum catches what the header checks do not)."""
    name, raw, ids, kv = kv_file
    blob = flip_bytes(raw, data)
    clean(lambda: _serve(args, name, blob, ids, kv), ())


# ---- usage history ------------------------------------------------------------------------
LAYERS, E, IDENT = [1, 2, 3], 8, "ident"
_HDR = struct.Struct("<8sQQ")


def _hist(payload: bytes) -> bytes:
    return _HDR.pack(HIST_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def _npy(descr: str, shape: tuple[int, ...], data_bytes: int) -> bytes:
    """A .npy member whose header declares `shape` whatever the bytes that follow."""
    head = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    head += b" " * (-(10 + len(head) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head + bytes(data_bytes)


def _zip(members: dict[str, bytes], compress: bool) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for k, v in members.items():
            z.writestr(k, v)
    return buf.getvalue()


def _load(path: Path) -> None:
    got = load_history(path, LAYERS, E, IDENT)
    if got is not None:
        assert got.shape == (len(LAYERS), E) and got.dtype == np.float64 and np.isfinite(got).all()


DIMS = st.one_of(st.integers(0, 10), st.sampled_from([2**20, 2**31, 2**33, 2**40, 2**62]))


@seeded
@fuzz_settings(120)
@given(data=st.data())
def test_fuzz_usage_history(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzz.hist"
    kind = data.draw(st.sampled_from(["bytes", "arrays", "declared"]), label="kind")
    if kind == "bytes":  # the saved file torn or flipped
        save_history(path, np.ones((len(LAYERS), E)), LAYERS, IDENT)
        blob = flip_bytes(path.read_bytes(), data)
    elif kind == "arrays":  # a valid container of the wrong arrays (dtype, shape, values, names)
        arrays: dict[str, np.ndarray] = {}
        for key in data.draw(st.lists(st.sampled_from(["identity", "layers", "counts", "other"]), unique=True,
                                      max_size=4), label="members"):
            shape = tuple(data.draw(st.lists(st.integers(0, 9), max_size=3), label="shape"))
            dtype = data.draw(st.sampled_from(["<f4", "<f8", "<i4", "<u1", "<U5", "|b1"]), label="dtype")
            fill = data.draw(st.sampled_from([0.0, 1.0, -1.0, np.inf, np.nan]), label="fill")
            with np.errstate(invalid="ignore"):  # NaN and inf cast to integers: any value will do
                arrays[key] = (np.full(shape, fill).astype(dtype) if dtype[1] not in "Ub"
                               else np.zeros(shape, dtype=dtype))
        if data.draw(st.booleans(), label="exact"):
            arrays = {"identity": np.array(IDENT), "layers": np.asarray(LAYERS, dtype=np.int32),
                      "counts": np.full((len(LAYERS), E), data.draw(st.floats(allow_nan=True)), dtype=np.float32)}
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        blob = _hist(buf.getvalue())
    else:  # members whose .npy headers declare any shape, stored or deflated, checksum right
        shape = tuple(data.draw(st.lists(DIMS, min_size=1, max_size=3), label="declared shape"))
        members = {"identity.npy": _npy("<U5", (), 20), "layers.npy": _npy("<i4", (3,), 12),
                   "counts.npy": _npy(data.draw(st.sampled_from(["<f4", "<f8", "|O"]), label="descr"), shape,
                                      data.draw(st.integers(0, 256), label="data bytes"))}
        if data.draw(st.booleans(), label="junk member"):
            members["x.npy"] = data.draw(st.binary(max_size=64), label="junk")
        blob = _hist(_zip(members, data.draw(st.booleans(), label="deflate")))
    path.write_bytes(blob)
    clean(lambda: _load(path), ())


@seeded
@fuzz_settings(40)
@given(doc=JSON_VALUES)
def test_fuzz_usage_history_not_npz(tmp_path_factory: pytest.TempPathFactory, doc: Any) -> None:
    """A payload that is not an npz at all (JSON, a bare .npy, a pickle's opcodes) with a valid checksum."""
    path = tmp_path_factory.getbasetemp() / "fuzz2.hist"
    for payload in (json.dumps(doc).encode(), b"\x80\x04" + json.dumps(doc).encode(), _npy("<f4", (2,), 8)):
        path.write_bytes(_hist(payload))
        clean(lambda: _load(path), ())
