"""Background threads run at the lowest CPU priority, so that they take no CPU time from the
step (moetier.background; only their own thread is lowered), and the prefix cache's disk writes
wait for a moment when nothing is stepped."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moetier.background import BACKGROUND_NICE, idle_class, lower_priority, thread_nice
from moetier.convert.synth import preset_args
from moetier.model.config import ModelArgs
from moetier.model.kv_cache import KVCache
from moetier.prefix_cache import PrefixCache

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread CPU priority here")


def test_lower_priority_lowers_the_calling_thread_only() -> None:
    before = thread_nice()
    seen: list[tuple[int, bool]] = []

    def body() -> None:
        assert lower_priority()
        seen.append((thread_nice(), idle_class()))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [(BACKGROUND_NICE, hasattr(os, "SCHED_IDLE"))]
    assert thread_nice() == before and not idle_class()  # the caller's own priority is untouched


def test_the_prefix_cache_writes_on_a_lowest_priority_thread(tmp_path: Path) -> None:
    cache = PrefixCache(preset_args("tiny-qwen3_moe"), "model", "identity", tmp_path, 1 << 20)
    try:
        assert cache._writer.submit(lambda: (thread_nice(), idle_class())).result() == (
            BACKGROUND_NICE, hasattr(os, "SCHED_IDLE"))
    finally:
        cache.close()


def _kv(args: ModelArgs, n: int, seed: int) -> KVCache:
    """A KV cache of n positions of random floats, shaped for args."""
    rng = np.random.default_rng(seed)
    empty = KVCache.for_model(args).to_arrays()
    arrays = {k: rng.standard_normal((n, *v.shape[1:])).astype(v.dtype) for k, v in empty.items() if k != "tokens"}
    arrays["tokens"] = rng.integers(3, 400, n).astype(np.int32)
    return KVCache.from_arrays(args, arrays)


def test_the_prefix_cache_writes_when_nothing_is_stepped(tmp_path: Path) -> None:
    """While its owner steps sequences a finished sequence's KV stays in memory (and is
    answered from there); the file is written once the owner is idle, or at once by flush."""
    args = preset_args("tiny-qwen3_moe")
    cache = PrefixCache(args, "model", "identity", tmp_path, 1 << 24)
    try:
        cache.stepping(True)
        a = _kv(args, 40, 1)
        assert cache.insert(a) == 40
        time.sleep(0.3)  # a writer that did not wait would have written it by now
        assert list(tmp_path.glob("*.kv")) == []
        got, n = cache.lookup([*a.tokens.tolist(), 7])
        assert n == 40 and got is not None  # from memory meanwhile
        cache.stepping(False)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(list(tmp_path.glob("*.kv"))) == 1
        cache.stepping(True)
        assert cache.insert(_kv(args, 33, 2)) == 33
        cache.flush(timeout=60)  # flush does not wait for an idle moment
        assert len(list(tmp_path.glob("*.kv"))) == 2
    finally:
        cache.close()


def test_an_entry_beyond_the_memory_budget_is_written_while_stepping(tmp_path: Path) -> None:
    """Waiting would hold it in memory past the budget (under a memory cap: an OOM kill), so it
    is written at once; once on disk it leaves memory."""
    args = preset_args("tiny-qwen3_moe")
    kv = _kv(args, 40, 3)
    cache = PrefixCache(args, "model", "identity", tmp_path, 1 << 24, memory_bytes=kv.nbytes // 2)
    try:
        cache.stepping(True)
        assert cache.insert(kv) == 40
        deadline = time.monotonic() + 10  # a deferred write would wait WRITE_DEFER_S (30 s)
        while not list(tmp_path.glob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(list(tmp_path.glob("*.kv"))) == 1
    finally:
        cache.close()
