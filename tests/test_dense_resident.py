"""The dense part held once (moetier.engine.load_dense): each dense file read into anonymous
memory with its page cache dropped as it goes; the tensors are the container's bits, read-only,
C-contiguous and aligned as in the file, and the forward pass over them is unchanged."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from moetier.convert.synth import write_container
from moetier.engine import load_dense
from moetier.errors import FormatError
from moetier.weights.container import Container
from moetier.weights.safetensors_io import read_resident


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_container("tiny-qwen3_moe", tmp_path_factory.mktemp("resident") / "m", 0)


def test_tensors_are_the_containers_bits_held_in_anonymous_memory(model: Path) -> None:
    with Container.open(model) as c:
        dense = load_dense(c)
        assert list(dense) == c.dense_names()
        for name, t in dense.items():
            ref = c.dense(name)
            assert (t.dtype, t.shape, t.group_size) == (ref.dtype, ref.shape, ref.group_size)
            for got, want in ((t.data, ref.data), (t.scales, ref.scales)):
                if want is None:
                    assert got is None
                    continue
                assert got is not None and got.dtype == want.dtype
                np.testing.assert_array_equal(got, want, err_msg=name)
                assert got.flags.c_contiguous and got.flags.aligned and not got.flags.writeable, name
                assert not isinstance(got, np.memmap) and not np.shares_memory(got, want), name
                # the file's alignment is kept: the buffer starts on a page
                assert got.ctypes.data % mmap.PAGESIZE == want.ctypes.data % mmap.PAGESIZE, name


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file), by mincore over a fresh map
    (mapping a file faults none of its pages in)."""
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc mincore to observe the page cache")
    mincore = ctypes.CDLL(libc, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        addr = np.frombuffer(m, dtype=np.uint8)
        rc = mincore(addr.ctypes.data, size, vec)
        del addr  # before the map closes
    if rc != 0:
        pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return sum(b & 1 for b in vec.raw), pages


def test_the_page_cache_keeps_no_second_copy(model: Path) -> None:
    path = next((model / "dense").glob("*.safetensors"))
    path.read_bytes()  # every page of the file into the page cache
    before, pages = cached_pages(path)
    if before < pages // 2:
        pytest.skip(f"only {before} of {pages} pages stayed cached after a read: nothing to observe here")
    data = read_resident(path)
    after, _ = cached_pages(path)
    assert after <= pages // 10, f"{after} of {pages} pages still cached"
    assert data.tobytes() == path.read_bytes()


def test_a_file_that_shrinks_while_read_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"\1" * 10000)
    real = os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return 0 if offset > 0 else real(fd, [buffers[0][:4096]], offset)

    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(FormatError, match="shrank to 4096 bytes"):
        read_resident(path)
