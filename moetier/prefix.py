"""Prefix identity shared by the router (affinity) and dense workers (prefix cache).

A token-id sequence is cut into blocks of BLOCK tokens; block i's hash chains the
hash of block i-1 with the ids of block i (xxh3_64), so a hash identifies the whole
prefix up to that block boundary. Two prompts share the first n blocks exactly
when their first n hashes are equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BLOCK = 16


def block_hashes(ids: Sequence[int] | np.ndarray, block: int = BLOCK, model_id: str = "") -> list[int]:
    """Chained 64-bit hashes of each complete block of `ids` (len(ids) // block of them)."""
    arr = np.asarray(ids, dtype=np.uint32)
    out: list[int] = []
    prev = xxhash.xxh3_64_intdigest(model_id.encode())
    for i in range(len(arr) // block):
        h = xxhash.xxh3_64()
        h.update(prev.to_bytes(8, "little"))
        h.update(arr[i * block : (i + 1) * block].tobytes())
        prev = h.intdigest()
        out.append(prev)
    return out


def shared_blocks(a: Sequence[int], b: set[int]) -> int:
    """How many leading block hashes of `a` appear in the set `b` (prefix match length, in blocks)."""
    n = 0
    for h in a:
        if h not in b:
            break
        n += 1
    return n
