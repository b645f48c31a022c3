"""The prefix cache alone (moetier/prefix_cache.py): token-granular lookup, files that survive a
restart bit for bit, atomic writes, the byte budget, and files that must not be trusted."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from moetier.convert.synth import preset_args
from moetier.model.config import ModelArgs
from moetier.model.kv_cache import KVCache
from moetier.prefix import BLOCK, block_hashes
from moetier.prefix_cache import MAGIC, PrefixCache, entry_key

MID, IDENTITY = "model-a", "kv-a"


# DSA: indexer keys in some layers only (tiny-glm_moe_dsa: full and shared indexer layers)
@pytest.fixture(scope="module", params=["tiny-deepseek_v3", "tiny-mixtral", "tiny-glm_moe_dsa"])
def args(request: pytest.FixtureRequest) -> ModelArgs:
    return preset_args(request.param)


def kv_of(args: ModelArgs, ids: list[int], seed: int = 0) -> KVCache:
    """A KV cache of len(ids) positions with random (but reproducible) contents."""
    rng = np.random.default_rng(seed)
    cache = KVCache.for_model(args)
    cache.reserve(len(ids))
    for i in range(args.num_layers):
        for name, shape in cache.layer_layout(i).items():
            cache.put(i, name, 0, rng.standard_normal((len(ids), *shape), dtype=np.float32))
    cache.commit(ids)
    return cache


def same_prefix(a: KVCache, b: KVCache, n: int) -> None:
    assert b.length == n
    arrays_a, arrays_b = a.to_arrays(), b.to_arrays()
    for name, arr in arrays_b.items():
        np.testing.assert_array_equal(arr, arrays_a[name][:n], err_msg=name)


def ids_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def test_lookup_reuses_every_cached_token_but_the_last(args: ModelArgs) -> None:
    cache = PrefixCache(args, MID, IDENTITY, None, 1 << 30)
    ids = ids_of(50, 1)
    kv = kv_of(args, ids)
    assert cache.insert(kv) == 50  # every position, the partial last block included
    for prompt, want in ((ids, 49), ([*ids, 7], 50), ([*ids, 7, 8], 50), (ids[:49], 48), (ids[:48], 47),
                         (ids[:33], 32), (ids[:31], 30), (ids[:30], 29), (ids[:17], 16), (ids[:16], 15),
                         (ids[:2], 1), (ids[:1], 0), ([*ids[:20], 1, 2, 3], 20), ([*ids[:5], 1, *ids[6:]], 5),
                         ([9, *ids], 0)):
        got, n = cache.lookup(prompt)
        assert n == want, len(prompt)
        if n:
            assert got is not None
            same_prefix(kv, got, n)
            got.reserve(1)  # a fresh copy: extending it leaves the cache's entry alone
            got.put(0, next(iter(got.layout)), n, np.ones((1, *next(iter(got.layout.values()))), np.float32))
            got.commit([1])
        else:
            assert got is None
    s = cache.stats()
    assert s.entries == 1 and s.hit_tokens == 49 + 50 + 50 + 48 + 47 + 32 + 30 + 29 + 16 + 15 + 1 + 20 + 5
    again, n = cache.lookup([*ids, 7])
    assert n == 50 and again is not None
    same_prefix(kv, again, 50)  # the extension above did not reach the entry


def test_entries_shorter_than_a_block(args: ModelArgs) -> None:
    cache = PrefixCache(args, MID, IDENTITY, None, 1 << 30)
    short = ids_of(10, 40)
    kv = kv_of(args, short)
    assert cache.insert(kv) == 10
    assert cache.hashes() == []  # no complete block: nothing for the router's affinity
    got, n = cache.lookup([*short, 3])
    assert n == 10 and got is not None
    same_prefix(kv, got, 10)
    assert cache.lookup(short[:6])[1] == 5
    assert cache.lookup([short[0] + 1, *short[1:]])[1] == 0
    longer = kv_of(args, [*short, *ids_of(20, 41)], seed=3)
    cache.insert(longer)
    assert cache.stats().entries == 1  # the short one is a prefix of the longer: superseded
    got, n = cache.lookup([*short, 3])
    assert n == 10 and got is not None
    same_prefix(longer, got, 10)


def test_the_candidate_sharing_most_tokens_wins(args: ModelArgs) -> None:
    """Entries sharing a system prompt (2 blocks + 5 tokens), then differing inside a block."""
    cache = PrefixCache(args, MID, IDENTITY, None, 1 << 30)
    system = ids_of(37, 50)
    a = [*system, *ids_of(12, 51)]
    b = [*system, *a[37:40], *ids_of(20, 52)]  # shares 40 tokens with a
    kv_a, kv_b = kv_of(args, a, seed=1), kv_of(args, b, seed=2)
    cache.insert(kv_a)
    cache.insert(kv_b)
    assert cache.stats().entries == 2
    for prompt, kv, want in (([*b[:45], 1], kv_b, 45), ([*a[:44], 1], kv_a, 44)):
        got, n = cache.lookup(prompt)
        assert n == want and got is not None
        same_prefix(kv, got, n)
    for prompt, want in (([*a[:40], 1, 1], 40), ([*system, 1], 37), (system[:20], 19)):
        got, n = cache.lookup(prompt)  # both hold these tokens (the same KV in a real model): either serves
        assert n == want and got is not None
        assert any(np.array_equal(got.get(0, name, n), kv.get(0, name, n)) for kv in (kv_a, kv_b)
                   for name in got.layout)


def test_longer_entry_supersedes_its_prefix(args: ModelArgs) -> None:
    cache = PrefixCache(args, MID, IDENTITY, None, 1 << 30)
    turn1 = ids_of(40, 2)
    cache.insert(kv_of(args, turn1))
    turn2 = turn1 + ids_of(30, 3)
    kv2 = kv_of(args, turn2, seed=1)
    cache.insert(kv2)
    assert cache.stats().entries == 1  # the first turn's tokens are answered by the second's entry
    got, n = cache.lookup([*turn1[:33], 7])
    assert n == 33 and got is not None
    same_prefix(kv2, got, 33)
    assert cache.hashes() == block_hashes(turn2, BLOCK, MID)
    assert cache.insert(kv_of(args, turn1, seed=5)) == 40  # a prefix of a held entry: nothing new is kept
    assert cache.stats().entries == 1 and cache.stats().inserts == 2
    got, n = cache.lookup([*turn2, 1])
    assert n == 70 and got is not None
    same_prefix(kv2, got, 70)


def test_files_survive_a_restart_bit_for_bit(args: ModelArgs, tmp_path: Path) -> None:
    ids = ids_of(70, 4)
    kv = kv_of(args, ids)
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    a.insert(kv)
    a.close()
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [file_name(ids)]  # no temporary left
    raw = files[0].read_bytes()
    assert raw[:8] == MAGIC
    hlen = struct.unpack("<Q", raw[8:16])[0]
    header = json.loads(raw[32 : 32 + hlen].rstrip(b"\0"))
    assert header["tokens"] == 70 and header["model_id"] == MID and header["kv_identity"] == IDENTITY
    assert header["hashes"] == [f"{h:016x}" for h in block_hashes(ids, BLOCK, MID)] and header["version"] == 2
    names = {a["name"] for a in header["arrays"]}
    indexer = [i for i, full in enumerate(args.indexer_layers) if full]
    assert {f"layers.{i}.index_k" for i in indexer} <= names  # DSA: the indexer keys persist with the KV
    assert header.get("extra") == ({str(i): {"index_k": [args.index_head_dim]} for i in indexer} or None)
    assert sum(a["nbytes"] for a in header["arrays"]) == kv.nbytes + 4 * 70  # the KV (indexer keys too) + ids
    b = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    assert b.stats().entries == 1 and b.stats().memory_bytes == 0
    assert set(block_hashes(ids[:64], BLOCK, MID)) == set(b.hashes())
    got, n = b.lookup([*ids, 5])
    assert n == 70 and got is not None
    same_prefix(kv, got, 70)
    assert b.stats().by_source["disk"] == 70
    got, n = b.lookup(ids[:51])  # a strict prefix of the cached sequence
    assert n == 50 and got is not None
    same_prefix(kv, got, 50)
    assert b.stats().by_source == {"disk": 70, "memory": 50}
    b.close()


def test_memory_budget_holds_in_memory_what_fits_and_reads_the_rest_from_files(args: ModelArgs,
                                                                               tmp_path: Path) -> None:
    """inference.prefix_cache_memory_bytes: with files, at most that many bytes of entries stay in
    memory (an entry larger than it too, until its file is written); every entry is still answered,
    bit for bit, the others from their files. Without a directory the memory is the whole budget."""
    seqs = [ids_of(40, 10 + i) for i in range(3)]
    kvs = [kv_of(args, ids, seed=i) for i, ids in enumerate(seqs)]
    one = kvs[0].nbytes + 4 * 40
    cache = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30, memory_bytes=one + one // 2)
    for kv in kvs:
        assert cache.insert(kv) == 40
    cache.flush()
    s = cache.stats()
    assert s.entries == 3 and s.memory_bytes == one and s.disk_bytes == 3 * one  # the newest in memory
    for kv, ids in reversed(list(zip(kvs, seqs, strict=True))):  # the newest first: from memory
        got, n = cache.lookup([*ids, 1])
        assert n == 40 and got is not None
        same_prefix(kv, got, 40)
    assert cache.stats().by_source == {"memory": 40, "disk": 80} and cache.stats().memory_bytes == one
    small = PrefixCache(args, MID, IDENTITY, tmp_path / "small", 1 << 30, memory_bytes=one // 2)
    small.insert(kvs[0])
    small.flush()
    assert small.stats().memory_bytes == 0 and small.stats().disk_bytes == one  # larger than memory: a file
    got, n = small.lookup([*seqs[0], 1])
    assert n == 40 and got is not None
    same_prefix(kvs[0], got, 40)
    small.close()
    cache.close()
    gone = PrefixCache(args, MID, IDENTITY, tmp_path / "gone", 1 << 30, memory_bytes=one // 2)
    shutil.rmtree(tmp_path / "gone")  # its file cannot be written: the entry leaves memory all the same
    gone.insert(kvs[0])
    gone.flush()
    assert gone.stats().write_errors == 1 and gone.stats().memory_bytes == 0 and gone.stats().entries == 0
    gone.close()
    mem = PrefixCache(args, MID, IDENTITY, None, 3 * one, memory_bytes=one)
    for kv in kvs:
        mem.insert(kv)
    assert mem.stats().entries == 3 and mem.stats().memory_bytes == 3 * one  # memory is the only tier


def file_name(ids: list[int]) -> str:
    return f"{entry_key(np.asarray(ids), block_hashes(ids, BLOCK, MID), MID):016x}.kv"


def test_version_1_files_are_read(args: ModelArgs, tmp_path: Path) -> None:
    """A version 1 file (whole blocks, named by its last block hash) is served as it is."""
    ids = ids_of(48, 6)
    kv = kv_of(args, ids)
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    a.insert(kv)
    a.close()
    path = tmp_path / file_name(ids)
    assert path.name == f"{block_hashes(ids, BLOCK, MID)[-1]:016x}.kv"
    raw = bytearray(path.read_bytes())
    hlen = struct.unpack("<Q", raw[8:16])[0]
    header = raw[32 : 32 + hlen]
    at = header.index(b'"version":2')
    raw[32 + at : 32 + at + 11] = b'"version":1'
    checksum = xxhash.xxh3_64(bytes(raw[32:])).intdigest()  # header and payload
    raw[24:32] = struct.pack("<Q", checksum)
    path.write_bytes(bytes(raw))
    b = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    got, n = b.lookup([*ids, 1])
    assert n == 48 and got is not None and b.stats().files_rejected == 0
    same_prefix(kv, got, 48)
    b.close()


def test_budget_evicts_least_recently_used(args: ModelArgs, tmp_path: Path) -> None:
    one = kv_of(args, ids_of(32, 0))
    entry_bytes = sum(a.nbytes for a in one.to_arrays().values())
    cache = PrefixCache(args, MID, IDENTITY, tmp_path, int(2.5 * entry_bytes))
    prompts = [ids_of(32, 10 + i) for i in range(3)]
    cache.insert(kv_of(args, prompts[0]))
    cache.insert(kv_of(args, prompts[1]))
    assert cache.lookup(prompts[0] + [1])[1] == 32  # 0 is now the most recent
    cache.insert(kv_of(args, prompts[2]))
    cache.flush()
    assert cache.lookup(prompts[1] + [1])[1] == 0  # evicted
    assert cache.lookup(prompts[0] + [1])[1] == 32 and cache.lookup(prompts[2] + [1])[1] == 32
    assert len(list(tmp_path.glob("*.kv"))) == 2
    s = cache.stats()
    assert s.evictions == 1 and s.disk_bytes <= 2.5 * entry_bytes
    assert cache.insert(kv_of(args, ids_of(200, 5))) == 0  # larger than the whole budget: not kept
    cache.close()


def test_corrupt_torn_and_foreign_files(args: ModelArgs, tmp_path: Path) -> None:
    prompts = [ids_of(40, 20 + i) for i in range(3)]
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    for p in prompts:
        a.insert(kv_of(args, p))
    a.close()
    name = {i: tmp_path / file_name(p) for i, p in enumerate(prompts)}
    raw = bytearray(name[0].read_bytes())
    raw[-5] ^= 1
    name[0].write_bytes(bytes(raw))  # one flipped bit in the payload
    name[1].write_bytes(name[1].read_bytes()[:-1])  # torn
    other = PrefixCache(args, "model-b", "kv-b", tmp_path / "b", 1 << 30)
    other.insert(kv_of(args, prompts[2]))
    other.close()
    foreign = next((tmp_path / "b").glob("*.kv")).rename(tmp_path / "0000000000000000.kv")
    (tmp_path / ".x.kv.1.0.tmp").write_bytes(b"half a write")  # a young temporary: another writer's, kept

    b = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    assert b.stats().files_rejected == 1 and not name[1].exists()  # torn: found by its size at start
    assert b.lookup(prompts[0] + [1]) == (None, 0)  # corrupt: found by the checksum when read
    assert b.stats().files_rejected == 2 and not name[0].exists()
    got, n = b.lookup(prompts[2] + [1])
    assert n == 40 and got is not None
    assert foreign.exists() and (tmp_path / ".x.kv.1.0.tmp").exists()  # other model's files are left alone
    b.close()


def test_other_model_or_shape_never_matches(args: ModelArgs, tmp_path: Path) -> None:
    ids = ids_of(40, 30)
    a = PrefixCache(args, MID, IDENTITY, tmp_path, 1 << 30)
    a.insert(kv_of(args, ids))
    a.close()
    b = PrefixCache(args, MID, "kv-other-weights", tmp_path, 1 << 30)  # same experts, other dense weights
    assert b.stats().entries == 0 and b.lookup(ids) == (None, 0)
    b.close()
    assert len(list(tmp_path.glob("*.kv"))) == 1  # left for its own worker
