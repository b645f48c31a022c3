"""The fixed-size state of hybrid linear-attention models (Gated DeltaNet, tiny-qwen3_next) in
the KV cache and the prefix cache: chunking and batching change no bit, snapshots at the
positions asked for are the state of exactly that prefix, resumption only where a state was
saved, files that survive a restart bit for bit, the byte budget, files that must not be trusted."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import helpers_hf as hf
import numpy as np
import pytest

from moetier.convert.synth import preset_args
from moetier.kernels import FastOps
from moetier.model.forward import Model
from moetier.model.kv_cache import KVCache
from moetier.prefix_cache import PrefixCache

PRESET = "tiny-qwen3_next"
MID, IDENTITY = "model-h", "kv-h"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    ckpt = hf.make_checkpoint(hf.SYNTH_MODULE, PRESET, tmp_path_factory.mktemp("hybrid") / "ckpt", 0)
    return hf.build_model(ckpt, FastOps())  # the engine's kernels: row-invariant


def ids_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def feed(model: Model, cache: KVCache, ids: list[int], chunks: list[int]) -> np.ndarray:
    """Logits [len(ids), V] of ids fed in chunks of the given sizes (the last takes the rest)."""
    out, at = [], 0
    for n in [*chunks, len(ids)]:
        part = ids[at : at + n]
        if part:
            out.append(model.step([(cache, np.array(part))], all_logits=True)[0])
        at += len(part)
    return np.concatenate(out)


def states(cache: KVCache) -> dict[str, np.ndarray]:
    return {k: v for k, v in cache.to_arrays().items() if k.startswith("state.")}


def test_chunks_and_batch_neighbours_change_no_bit(model: Model) -> None:
    ids = ids_of(37, 1)
    whole = model.new_cache()
    ref = feed(model, whole, ids, [])
    for chunks in ([1] * 37, [5, 1, 16, 3], [36]):
        c = model.new_cache()
        np.testing.assert_array_equal(feed(model, c, ids, chunks), ref, err_msg=str(chunks))
        for k, v in states(whole).items():
            np.testing.assert_array_equal(states(c)[k], v, err_msg=k)
    # in one step with two other sequences
    a, b, c = model.new_cache(), model.new_cache(), model.new_cache()
    out = model.step([(a, np.array(ids_of(9, 2))), (b, np.array(ids)), (c, np.array(ids_of(3, 3)))], all_logits=True)
    np.testing.assert_array_equal(out[1], ref)
    assert b.state_positions == [37]


def test_snapshots_are_the_state_of_that_prefix(model: Model) -> None:
    ids = ids_of(40, 4)
    cache = model.new_cache()
    cache.save_at.update({1, 16, 29, 40})  # 16: a chunk's end, 29: inside a chunk, 40: the end
    feed(model, cache, ids, [16, 10])
    assert cache.state_positions == [1, 16, 29, 40]
    for p in (1, 16, 29):
        short = model.new_cache()
        feed(model, short, ids[:p], [])
        got = {k.replace(f"state.{p}.", "", 1): v for k, v in states(cache).items() if k.startswith(f"state.{p}.")}
        want = {k.replace(f"state.{p}.", "", 1): v for k, v in states(short).items()}
        assert got.keys() == want.keys() and got
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{p} {k}")
    # rolled back to a saved position, the continuation is the uninterrupted one
    tail = model.new_cache()
    ref = feed(model, tail, ids, [])
    cache.truncate(29)
    np.testing.assert_array_equal(feed(model, cache, ids[29:], []), ref[29:])
    with pytest.raises(ValueError, match="no recurrent state saved at position 20"):
        cache.truncate(20)
    cache.truncate(0)
    np.testing.assert_array_equal(feed(model, cache, ids, []), ref)


def test_round_trip_and_bad_arrays(model: Model) -> None:
    ids = ids_of(20, 5)
    cache = model.new_cache()
    cache.save_at.add(7)
    feed(model, cache, ids, [])
    arrays = cache.to_arrays()
    back = KVCache.from_arrays(model.args, arrays)
    assert back.state_positions == [7, 20]
    for k, v in back.to_arrays().items():
        np.testing.assert_array_equal(v, arrays[k], err_msg=k)
    short = {k: (v[:7] if not k.startswith("state.") else v) for k, v in arrays.items()}
    assert KVCache.from_arrays(model.args, short).state_positions == [7]
    no_state = {k: v for k, v in short.items() if not k.startswith("state.7.")}
    with pytest.raises(ValueError, match="lack the recurrent state at 7"):
        KVCache.from_arrays(model.args, no_state)
    wrong = dict(arrays)
    key = next(k for k in arrays if k.startswith("state.20.") and k.endswith(".ssm"))
    wrong[key] = arrays[key][:1]
    with pytest.raises(ValueError, match="has shape"):
        KVCache.from_arrays(model.args, wrong)


def test_prefix_cache_resumes_only_at_saved_states_and_persists(model: Model, tmp_path: Path) -> None:
    args = preset_args(PRESET)
    ids = ids_of(50, 6)
    kv = model.new_cache()
    kv.save_at.add(33)
    feed(model, kv, ids, [])
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    assert a.insert(kv) == 50
    state_bytes = 4 * args.state_floats
    assert kv.nbytes == 4 * 50 * args.kv_floats_per_token + 2 * state_bytes  # two saved states
    for prompt, want in ((ids, 33), ([*ids, 1], 50), (ids[:40], 33), (ids[:34], 33), (ids[:33], 0), (ids[:20], 0)):
        got, n = a.lookup(prompt)
        assert n == want, len(prompt)
        assert (got is None) == (n == 0)
        if got is not None:
            assert got.length == n and got.state_positions[-1] == n
    a.close()
    b = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    got, n = b.lookup([*ids, 1])
    assert n == 50 and got is not None
    for k, v in kv.to_arrays().items():
        np.testing.assert_array_equal(got.to_arrays()[k], v, err_msg=k)
    assert b.stats().by_source["disk"] == 50
    # continuing from the restored state equals continuing the original
    more = ids_of(5, 7)
    np.testing.assert_array_equal(feed(model, got, more, []), feed(model, kv, more, []))
    b.close()


def test_budget_counts_states_and_a_tampered_header_is_rejected(model: Model, tmp_path: Path) -> None:
    args = preset_args(PRESET)
    kv = model.new_cache()
    feed(model, kv, ids_of(30, 8), [])
    positions_only = 4 * 30 * args.kv_floats_per_token + 4 * 30
    too_small = PrefixCache(args, MID, IDENTITY, None, positions_only + 4 * args.state_floats - 1)
    assert too_small.insert(kv) == 0  # the state does not fit the budget
    c = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    c.insert(kv)
    c.close()
    (path,) = tmp_path.glob("*.kv")
    raw = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<Q", raw, 8)[0]
    header = json.loads(bytes(raw[32 : 32 + hlen]).rstrip(b"\0"))
    assert header["states"] == [30] and set(header["state"]) == {"0", "1", "2"}
    text = bytes(raw[32 : 32 + hlen]).replace(b'"states":[30]', b'"states":[31]')
    raw[32 : 32 + hlen] = text
    path.write_bytes(bytes(raw))
    d = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    assert d.stats().entries == 0 and d.stats().files_rejected == 1
    d.close()


def test_a_finished_sequence_is_handed_over_without_a_copy(model: Model, tmp_path: Path) -> None:
    """insert(handover=True) keeps views of the cache's own arrays (no second copy of the KV at a
    request's end), counts its capacity against the memory budget, and answers the same bits."""
    ids = ids_of(40, 9)
    caches = []
    for seed in (0, 1):
        c = model.new_cache()
        c.save_at.add(39)
        feed(model, c, ids_of(40, 9 + seed), [16])
        caches.append(c)
    want = caches[0].to_arrays()
    pc = PrefixCache(model.args, MID, IDENTITY, tmp_path, 1 << 30, memory_bytes=1 << 30)
    assert pc.insert(caches[0], handover=True) == 40
    held = pc.stats().memory_bytes
    assert held == caches[0].capacity_bytes + 4 * caches[0].capacity > caches[0].nbytes + 4 * 40
    entry = next(e for e in pc._entries.values() if e.tokens == 40 and e.arrays is not None)
    assert entry.arrays is not None and entry.arrays.keys() == want.keys()
    assert all(np.shares_memory(entry.arrays[k], v) for k, v in caches[0].to_arrays(copy=False).items())
    assert pc.insert(caches[1]) == 40  # a copy: counted as its payload
    assert pc.stats().memory_bytes == held + caches[1].nbytes + 4 * 40
    other = next(e for e in pc._entries.values() if e is not entry)
    assert other.arrays is not None
    assert not any(np.shares_memory(other.arrays[k], v) for k, v in caches[1].to_arrays(copy=False).items())
    pc.flush()
    kv, n = pc.lookup([*ids, 5])
    assert n == 40 and kv is not None
    for k, v in kv.to_arrays().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    pc.close()
