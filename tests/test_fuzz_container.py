"""Property-based fuzzing of the container reader: moetier.json, experts/index.json, the dense
safetensors headers and their moetier metadata, the record layout and the expert records.
Whatever the bytes, opening gives a FormatError/DataCorruption naming the problem (or a
container that is valid), never another exception or an allocation a length field asked for."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers_fuzz import JSON_VALUES, TIMEOUT_S, clean, flip_bytes, fuzz_settings, mutate, seeded
from hypothesis import given
from hypothesis import strategies as st
from test_container import build

from moetier.errors import DataCorruption
from moetier.weights import Container
from moetier.weights.format import INDEX, MANIFEST, json_bytes
from moetier.weights.index import ExpertIndex, index_identity
from moetier.weights.layout import RecordLayout
from moetier.weights.safetensors_io import DTYPES, MappedFile, read_header

pytestmark = pytest.mark.timeout(TIMEOUT_S)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fuzz") / "c")


class Scratch:
    """A copy of the good container; each example rewrites some files and `reset` puts them back."""

    def __init__(self, good: Path, root: Path) -> None:
        self.root = root
        shutil.copytree(good, root)
        self.orig = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        self.touched: set[str] = set()

    def write(self, rel: str, data: bytes) -> None:
        self.touched.add(rel)
        (self.root / rel).write_bytes(data)

    def json(self, rel: str) -> Any:
        return json.loads(self.orig[rel])

    def reset(self) -> None:
        for rel in self.touched:
            if rel in self.orig:
                (self.root / rel).write_bytes(self.orig[rel])
            else:
                (self.root / rel).unlink(missing_ok=True)
        self.touched.clear()

    def resize_in_manifest(self, manifest: Any, rel: str) -> Any:
        """The manifest with `rel`'s size set to the file's new size (so the reader gets past it)."""
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(
                manifest["files"].get(rel), dict):
            manifest["files"][rel]["size"] = (self.root / rel).stat().st_size
        return manifest


@pytest.fixture(scope="module")
def scratch(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scratch]:
    s = Scratch(good, tmp_path_factory.mktemp("scratch") / "c")
    yield s
    s.reset()


def _open(root: Path, verify: bool = False) -> None:
    Container.open(root, verify=verify).close()


@seeded
@fuzz_settings(120)
@given(data=st.data())
def test_fuzz_manifest(scratch: Scratch, data: st.DataObject) -> None:
    try:
        scratch.write(MANIFEST, json_bytes(mutate(scratch.json(MANIFEST), data)))
        clean(lambda: _open(scratch.root))
    finally:
        scratch.reset()


@seeded
@fuzz_settings(80)
@given(data=st.data())
def test_fuzz_manifest_bytes(scratch: Scratch, data: st.DataObject) -> None:
    try:
        scratch.write(MANIFEST, flip_bytes(scratch.orig[MANIFEST], data))
        clean(lambda: _open(scratch.root))
    finally:
        scratch.reset()


@seeded
@fuzz_settings(150)
@given(data=st.data(), fix_identity=st.booleans())
def test_fuzz_expert_index(scratch: Scratch, data: st.DataObject, fix_identity: bool) -> None:
    """Mutated experts/index.json, half the time with its identity recomputed and its size put
    in the manifest, so the checks behind those two are reached too."""
    try:
        doc = mutate(scratch.json(INDEX), data)
        if fix_identity and isinstance(doc, dict):
            with contextlib.suppress(TypeError, ValueError):
                doc["identity"] = index_identity(doc.get("layout"), doc.get("files"), doc.get("records"))  # type: ignore[arg-type]
        scratch.write(INDEX, json_bytes(doc))
        scratch.write(MANIFEST, json_bytes(scratch.resize_in_manifest(scratch.json(MANIFEST), INDEX)))
        clean(lambda: _open(scratch.root))
        clean(lambda: ExpertIndex.load(scratch.root))  # the bare-record-set reader (synth, bench io)
    finally:
        scratch.reset()


@seeded
@fuzz_settings(100)
@given(data=st.data())
def test_fuzz_record_layout(good: Path, data: st.DataObject) -> None:
    layout = json.loads((good / INDEX).read_bytes())["layout"]
    clean(lambda: RecordLayout.from_dict(mutate(layout, data)))


def _dense_rel(scratch: Scratch) -> str:
    return sorted(r for r in scratch.orig if r.startswith("dense/"))[0]


def _safetensors(header: Any, data_bytes: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_bytes)


DIMS = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**33, 2**62, 2**63 - 1, 2**64]),
                 st.integers(-(2**65), 2**65))
ENTRY = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(DTYPES)), JSON_VALUES),
    "shape": st.one_of(st.lists(DIMS, max_size=5), JSON_VALUES),
    "data_offsets": st.one_of(st.lists(DIMS, min_size=2, max_size=2), JSON_VALUES),
})


@seeded
@fuzz_settings(200)
@given(tensors=st.dictionaries(st.text(max_size=6), ENTRY, max_size=4), meta=st.one_of(JSON_VALUES, st.just({})),
       data_bytes=st.integers(0, 512))
def test_fuzz_safetensors_header(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, Any], meta: Any,
                                 data_bytes: int) -> None:
    """Generated headers: any dtype, shapes with negative, huge and overflowing dimensions,
    offsets anywhere, metadata of any type. read_header and the memmap views must agree."""
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(_safetensors({**tensors, "__metadata__": meta}, data_bytes))

    def read() -> None:
        mf = MappedFile(path)
        try:
            for name in mf.header.tensors:
                mf.raw(name)  # every tensor the header accepted is a valid view of its bytes
        finally:
            mf.close()

    clean(read)


@seeded
@fuzz_settings(120)
@given(data=st.data())
def test_fuzz_dense_file(scratch: Scratch, data: st.DataObject) -> None:
    """A dense file of the container with its header bytes changed, or its moetier metadata
    mutated (the file rewritten with the same data region), then the whole container opened."""
    rel = _dense_rel(scratch)
    orig = scratch.orig[rel]
    try:
        if data.draw(st.booleans(), label="metadata"):
            (n,) = struct.unpack("<Q", orig[:8])
            header = json.loads(orig[8:8 + n])
            meta = json.loads(header["__metadata__"]["moetier"])
            header["__metadata__"]["moetier"] = json.dumps(mutate(meta, data))
            raw = json.dumps(header).encode()
            raw += b" " * (n - len(raw)) if len(raw) < n else b""
            blob = struct.pack("<Q", len(raw)) + raw + orig[8 + n:]
        else:
            (n,) = struct.unpack("<Q", orig[:8])
            blob = flip_bytes(orig, data, limit=8 + n)
        scratch.write(rel, blob)
        scratch.write(MANIFEST, json_bytes(scratch.resize_in_manifest(scratch.json(MANIFEST), rel)))
        clean(lambda: read_header(scratch.root / rel))
        clean(lambda: _open(scratch.root))
    finally:
        scratch.reset()


@seeded
@fuzz_settings(60)
@given(data=st.data())
def test_fuzz_expert_records(scratch: Scratch, data: st.DataObject) -> None:
    """Corrupted expert files: verification names the layer, expert, file and offset; a parse of
    any buffer is the layout's views or a FormatError."""
    rel = sorted(r for r in scratch.orig if r.startswith("experts/") and r.endswith(".bin"))[0]
    try:
        blob = flip_bytes(scratch.orig[rel], data)
        scratch.write(rel, blob)
        scratch.write(MANIFEST, json_bytes(scratch.resize_in_manifest(scratch.json(MANIFEST), rel)))
        err = clean(lambda: _open(scratch.root, verify=True))
        if blob != scratch.orig[rel] and len(blob) == len(scratch.orig[rel]):
            assert isinstance(err, DataCorruption) and "checksum mismatch" in str(err)
        lay = RecordLayout.from_dict(json.loads(scratch.orig[INDEX])["layout"])
        cut = data.draw(st.integers(0, lay.record_bytes), label="buffer bytes")
        clean(lambda: lay.parse(np.frombuffer(blob[:cut], dtype=np.uint8)))
    finally:
        scratch.reset()
