"""Background threads run at the lowest CPU priority, so that they take no CPU time from the
step (moetier.background); only their own thread is lowered."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from moetier.background import BACKGROUND_NICE, lower_priority, thread_nice
from moetier.convert.synth import preset_args
from moetier.prefix_cache import PrefixCache

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread CPU priority here")


def test_lower_priority_lowers_the_calling_thread_only() -> None:
    before = thread_nice()
    seen: list[int] = []

    def body() -> None:
        assert lower_priority()
        seen.append(thread_nice())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [BACKGROUND_NICE]
    assert thread_nice() == before  # the caller's own priority is untouched


def test_the_prefix_cache_writes_on_a_lowest_priority_thread(tmp_path: Path) -> None:
    cache = PrefixCache(preset_args("tiny-qwen3_moe"), "model", "identity", tmp_path, 1 << 20)
    try:
        assert cache._writer.submit(thread_nice).result() == BACKGROUND_NICE
    finally:
        cache.close()
