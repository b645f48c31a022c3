"""The prefix cache: KV of finished sequences, kept in memory and on disk, reused by later
prompts that extend them (multi-turn conversations, shared system prompts).

    cache = PrefixCache(args, model_id, kv_identity, directory, budget_bytes)
    kv, n = cache.lookup(prompt_ids)   # KVCache holding the first n prompt tokens, or (None, 0)
    cache.insert(kv)                   # remember a sequence's KV (every committed position)
    cache.hashes()                     # block hashes of every cached prefix (router affinity)
    cache.close()                      # waits for pending disk writes

Granularity: token. An entry holds the KV of a whole sequence (any number of tokens) and
answers for every prefix of itself, so a conversation's next turn reuses everything the
last one computed, up to the first token where the two differ. The index is block-based
(blocks of moetier.prefix.BLOCK tokens, the router's affinity unit): each of an entry's
chained block hashes points at it, the longest block match narrows the candidates, and the
candidates' token ids (always held in memory, 4 bytes a token) settle the match to the
token, a partial last block included. A lookup never returns the whole prompt: at least
the last prompt token is left to prefill, because its logits choose the first generated
token. An entry whose tokens are a prefix of a newer one is dropped: the newer answers
for it.

Identity: block hashes are `moetier.prefix.block_hashes(ids, block, model_id)` with the
model id the worker registers (the router hashes prompts the same way). A file also
carries `kv_identity`, which covers everything the KV bits depend on (dense weights,
expert index, model shape); a file of another identity is ignored.

Memory and disk share one budget (`budget_bytes`): at most that many bytes of entries in
memory, and as many in files; the least recently used go first. A new entry is written
to disk by a background thread (never on the step's critical path); a file that is torn,
truncated or fails its checksum is logged, removed and never used. The writer runs at the
lowest CPU priority (moetier.background), and where the owner says when it is stepping
(`stepping(True/False)`, as the dense worker's batcher does) it writes array by array in moments
when nothing is stepped, for at most WRITE_DEFER_S. Writing a 1k-token request's KV (256 MiB
for OLMoE) copies it into the page cache, and on 2 cores that copy slowed the decode of the next
request from 46 to 41 tok/s even at the lowest priority (the kernels' threads leave cores idle
between their jobs, and the copy takes memory bandwidth from them). It waits only while the
entries held in memory fit the memory budget: an entry that must leave memory is written at
once (held back under a memory cap, a 1k-token KV got the dense worker OOM-killed).

File format (one file per entry, `<entry key, 16 hex digits>.kv`; the key is the entry's
last block hash when it holds whole blocks, else that hash chained with the remaining
tokens, see `entry_key`), little endian:

    0   8 bytes   magic b"MTPFXKV1"
    8   u64       H: header length
    16  u64       P: payload length
    24  u64       xxh3_64 over the header bytes followed by the payload bytes
    32  H bytes   header: canonical JSON (see `_header`), zero-padded to a multiple of 64
    ..  P bytes   payload: the arrays named in the header, each at its offset (64-aligned),
                  "tokens" int32 [n] then "layers.{i}.{name}" float32 [n, ...] per layer (DSA:
                  also "layers.{i}.index_k" of the indexer layers, listed in the header's "extra")

Models with a fixed-size state (the Gated DeltaNet layers of Qwen3-Next / Qwen3.5) are
resumable only where that state was saved: an entry also holds the state at each of its
`states` positions (arrays "state.{p}.layers.{i}.{conv,ssm}", the header's "state" lists the
layers and shapes), and answers a lookup at the longest of those positions within the shared
prefix, not at any token. The positions are the ones a later request can resume at (see
docs/internals.md, "Recurrent state"): the end of the prompt less one token (the same prompt
again: a retry, another sample, another user's identical request) and the sequence's end
(the conversation's next turn); the dense worker and the engine ask for the first
(`KVCache.save_at`), the second is the state the sequence ends with. An entry supersedes an
older one only if it holds every position the older one could resume at.

Version 2 entries hold any number of tokens ("hashes" lists the complete blocks); version 1
files (whole blocks only, the same layout) are read as they are.

Written to a temporary file in the same directory, fsynced, renamed into place, then the
directory is fsynced: a reader sees a whole file or none. No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from moetier.background import lower_priority
from moetier.errors import FormatError
from moetier.model.config import ModelArgs
from moetier.model.kv_cache import KVCache, cache_extra, cache_layout, cache_state, cache_windows, state_key
from moetier.prefix import BLOCK, block_hashes

log = logging.getLogger(__name__)

MAGIC = b"MTPFXKV1"
WRITE_DEFER_S = 30.0  # the longest a disk write waits for a moment when nothing is stepped
FORMAT = "moetier-prefix-kv"
VERSION = 2
READABLE = (1, 2)  # version 1: the same layout, whole blocks only
SUFFIX = ".kv"
_PRE = struct.Struct("<8sQQQ")  # magic, header length, payload length, checksum
ALIGN = 64
STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's

Arrays = dict[str, np.ndarray]


class _NotResumable(Exception):
    """A prefix entry whose sliding-window layers no longer hold the window of the shared length."""


def kv_identity(container_files: dict[str, Any], index_identity: str, args: ModelArgs) -> str:
    """What a KV entry's bits depend on: the dense files, the expert index and the model shape."""
    dense = {k: v for k, v in sorted(container_files.items()) if k.startswith("dense/")}
    obj = {"dense": dense, "experts": index_identity, "model": args.to_dict(), "kv_dtype": "float32"}
    return xxhash.xxh3_64_hexdigest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


class _Foreign(FormatError):
    """A well-formed file of another model (a shared directory): left alone."""


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def entry_key(ids: npt.NDArray[np.integer], hashes: Sequence[int], model_id: str) -> int:
    """An entry's name: its last block hash when it holds whole blocks; otherwise that hash
    (the model id's seed when it has no complete block) chained with the remaining tokens."""
    tail = np.asarray(ids[len(hashes) * BLOCK :], dtype=np.uint32)
    if len(tail) == 0:
        return hashes[-1]
    prev = hashes[-1] if hashes else xxhash.xxh3_64_intdigest(model_id.encode())
    h = xxhash.xxh3_64()
    h.update(prev.to_bytes(8, "little"))
    h.update(b"tail")  # never the input of a block hash: those are 8 + 64 bytes
    h.update(tail.tobytes())
    return h.intdigest()


def _common(a: npt.NDArray[np.integer], b: npt.NDArray[np.integer]) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class _Entry:
    key: int  # entry_key of its tokens
    hashes: list[int]  # chained hashes of its complete blocks
    ids: npt.NDArray[np.int32]  # its tokens [n]
    nbytes: int  # payload bytes (tokens + KV)
    states: frozenset[int] | None = None  # where a fixed-size state is saved (None: no such state, any position)
    arrays: Arrays | None = None  # in memory (None: on disk only)
    on_disk: bool = False
    writing: Future[None] | None = None
    memory: int = 0  # bytes its arrays keep in memory while held (nbytes, or a handed-over cache's capacity)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def resumable(self, n: int) -> int:
        """The longest prefix of at most n tokens this entry can resume at."""
        if self.states is None:
            return n
        return max((p for p in self.states if p <= n), default=0)

    def covers(self, other: _Entry) -> bool:
        """Whether this entry can resume everywhere `other` can (it holds other's tokens)."""
        return self.states is None or (other.states is not None and other.states <= self.states)


@dataclass
class PrefixStats:
    entries: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0
    lookups: int = 0
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, served from the cache
    inserts: int = 0
    evictions: int = 0
    files_written: int = 0
    files_rejected: int = 0  # torn, corrupt or foreign files ignored
    write_errors: int = 0
    by_source: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})  # hit tokens


class PrefixCache:
    def __init__(self, args: ModelArgs, model_id: str, identity: str, directory: Path | None,
                 budget_bytes: int, *, memory_bytes: int | None = None, block: int = BLOCK) -> None:
        if block != BLOCK:
            raise ValueError(f"prefix cache blocks are {BLOCK} tokens (moetier.prefix.BLOCK), not {block}")
        self.args = args
        self.model_id = model_id
        self.identity = identity
        self.directory = directory
        self.budget = int(budget_bytes)
        # entries held in memory: at most memory_bytes of them where they also have files (the
        # others are read back from their files), all of them without a directory
        self.memory_budget = self.budget if memory_bytes is None or directory is None else min(
            int(memory_bytes), self.budget)
        self.layout = {k: list(v) for k, v in cache_layout(args).items()}
        # arrays only some layers keep (the DSA indexer keys): {layer: {name: shape}}
        self.extra = {str(i): {k: list(v) for k, v in lay.items()} for i, lay in cache_extra(args).items()}
        # the fixed-size state of the linear-attention layers: {layer: {name: shape}}
        self.state = {str(i): {k: list(v) for k, v in lay.items()} for i, lay in cache_state(args).items()}
        self.windows = cache_windows(args)  # sliding-window layers keep their last positions only
        self._lock = threading.RLock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[int, set[int]] = {}  # block hash -> keys of the entries holding that block prefix
        self._first: dict[int, set[int]] = {}  # first token id -> keys of the entries starting with it
        self._stats = PrefixStats()
        # the writer yields the CPU to the step (moetier.background)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-cache-writer",
                                          initializer=lower_priority)
        self._tmp = count()
        self._quiet = threading.Event()  # nothing is being stepped (see `stepping`)
        self._quiet.set()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, ids: Sequence[int] | npt.NDArray[np.integer]) -> tuple[KVCache | None, int]:
        """The longest cached prefix of ids[:-1]: (a fresh KVCache of it, its tokens)."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        query = arr[: max(len(arr) - 1, 0)]
        hashes = block_hashes(query, BLOCK, self.model_id)
        with self._lock:
            self._stats.lookups += 1
            self._stats.query_tokens += len(arr)
        while len(query):
            with self._lock:
                best = self._best(query, hashes)
            if best is None:
                break
            entry, n = best
            try:
                found = self._load(entry, n)
            except _NotResumable as e:  # its sliding-window layers no longer reach back to n: a miss
                log.info("prefix cache: %s", e)
                break
            if found is None:
                continue  # its file was rejected and the entry dropped: look again
            kv, source = found
            with self._lock:
                self._stats.hit_tokens += n
                self._stats.by_source[source] += n
            return kv, n
        return None, 0

    def _best(self, query: npt.NDArray[np.int64], hashes: list[int]) -> tuple[_Entry, int] | None:
        """The entry sharing the longest (resumable) prefix with `query` and that length (under the
        lock). The candidates are the holders of the longest matching block prefix: no other entry
        can share more, since sharing one more block would put it among the holders of that block."""
        candidates: Iterable[int] = ()
        if self.state:
            # resumable only at saved states: an entry sharing fewer blocks may resume later than
            # one sharing more, so every entry starting with this token is a candidate
            candidates = self._first.get(int(query[0]), ())
        else:
            for k in range(len(hashes), 0, -1):
                if hashes[k - 1] in self._index:
                    candidates = self._index[hashes[k - 1]]
                    break
            else:  # no block in common: an entry starting with the same token may share part of the first
                candidates = self._first.get(int(query[0]), ())
        best: tuple[_Entry, int] | None = None
        for key in candidates:
            e = self._entries[key]
            n = e.resumable(_common(e.ids, query))
            # longest match first, then one held in memory (no file to read)
            if n and (best is None or (n, e.arrays is not None) > (best[1], best[0].arrays is not None)):
                best = (e, n)
        return best

    def _load(self, entry: _Entry, n: int) -> tuple[KVCache, str] | None:
        """The first n positions of the entry as a fresh KVCache, and where they came from."""
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
            arrays = entry.arrays
        source = "memory"
        if arrays is None:
            source = "disk"
            arrays = self._read(entry)
            if arrays is None:
                return None
            with self._lock:
                if self._entries.get(entry.key) is entry:
                    entry.arrays, entry.memory = arrays, entry.nbytes
                    self._trim_memory()
        try:  # the first n positions (a sliding-window layer must still hold the window of position n)
            return KVCache.from_arrays(self.args, arrays, n), source
        except ValueError as e:
            raise _NotResumable(f"an entry of {entry.tokens} tokens cannot resume at {n}: {e}") from None

    # ---- insert ----------------------------------------------------------------------
    def insert(self, kv: KVCache, *, handover: bool = False) -> int:
        """Remember every committed position of a sequence's KV; returns the tokens kept (0: none).
        handover=True: the caller never writes `kv` again (a finished sequence), so the entry
        holds views of its arrays instead of a copy: a 1k-token OLMoE request's KV is 256 MiB,
        and the copy doubled the dense worker's memory at the end of every long request (its
        peak under a memory cap). The entry then counts the cache's capacity against the
        memory budget, not just its positions."""
        n = kv.length
        if n == 0:
            return 0
        nbytes = kv.nbytes + 4 * n  # KV and token ids, as persisted
        if nbytes > self.budget:
            return 0
        ids = np.array(kv.tokens, dtype=np.int32)
        hashes = block_hashes(ids, BLOCK, self.model_id)
        key = entry_key(ids, hashes, self.model_id)
        states = frozenset(p for p in kv.state_positions if p > 0) if self.state else None
        new = _Entry(key, hashes, ids, nbytes, states)
        with self._lock:
            holder = self._holder(new)
            if holder is not None:  # the same tokens, or a sequence extending them
                self._entries.move_to_end(holder.key)
                return n
            # entries that are prefixes of this one are answered by it from now on
            for e in self._prefixes_of(new):
                self._drop(e, "superseded")
            if key in self._entries:  # the same tokens, other saved states: one file per key
                self._drop(self._entries[key], "superseded")
            entry = new
            entry.arrays = kv.to_arrays(copy=not handover)
            entry.memory = kv.capacity_bytes + 4 * kv.capacity if handover else nbytes
            self._add(entry)
            self._stats.inserts += 1
            if self.directory is not None:
                entry.writing = self._writer.submit(self._write, entry)
            self._trim_memory()
            self._trim_disk()
        return n

    def _holder(self, new: _Entry) -> _Entry | None:
        """An entry holding all of `new`'s tokens and able to resume wherever it can (under the lock)."""
        ids, hashes = new.ids, new.hashes
        keys = self._index.get(hashes[-1], ()) if hashes else self._first.get(int(ids[0]), ())
        for key in keys:
            e = self._entries[key]
            if e.tokens >= len(ids) and _common(e.ids, ids) == len(ids) and e.covers(new):
                return e
        return None

    def _prefixes_of(self, new: _Entry) -> list[_Entry]:
        """The entries whose tokens are a prefix of `new`'s and which it covers (under the lock)."""
        ids, hashes = new.ids, new.hashes
        keys = {k for k in self._first.get(int(ids[0]), ()) if not self._entries[k].hashes}
        for i, h in enumerate(hashes):
            keys.update(k for k in self._index.get(h, ()) if len(self._entries[k].hashes) == i + 1)
        out = []
        for key in keys:
            e = self._entries[key]
            if e.tokens <= len(ids) and _common(e.ids, ids) == e.tokens and new.covers(e):
                out.append(e)
        return out

    # ---- reporting -------------------------------------------------------------------
    def hashes(self, limit: int = 8192) -> list[int]:
        """Block hashes of the cached prefixes, most recently used entries first."""
        out: list[int] = []
        seen: set[int] = set()
        with self._lock:
            for entry in reversed(self._entries.values()):
                for h in entry.hashes:
                    if h not in seen:
                        seen.add(h)
                        out.append(h)
                if len(out) >= limit:
                    return out[:limit]
        return out

    def stats(self) -> PrefixStats:
        with self._lock:
            s = self._stats
            return PrefixStats(len(self._entries), self._held_bytes(),
                               sum(e.nbytes for e in self._entries.values() if e.on_disk), s.lookups,
                               s.query_tokens, s.hit_tokens, s.inserts, s.evictions, s.files_written,
                               s.files_rejected, s.write_errors, dict(s.by_source))

    def stepping(self, busy: bool) -> None:
        """The owner is stepping sequences (True) or idle (False): disk writes wait for an idle
        moment, at most WRITE_DEFER_S, while the entries held in memory fit its budget (see the
        module docstring)."""
        if busy:
            self._quiet.clear()
        else:
            self._quiet.set()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the disk writes queued so far (at once: they no longer wait for a quiet moment)."""
        self._quiet.set()
        with self._lock:
            pending = [e.writing for e in self._entries.values() if e.writing is not None]
        for f in pending:
            with contextlib.suppress(Exception):  # a failed write is counted and logged by the writer
                f.result(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        self.flush(timeout)
        self._writer.shutdown(wait=True, cancel_futures=True)

    # ---- bookkeeping (under the lock) -------------------------------------------------
    def _add(self, entry: _Entry) -> None:
        self._entries[entry.key] = entry
        self._first.setdefault(int(entry.ids[0]), set()).add(entry.key)
        for h in entry.hashes:
            self._index.setdefault(h, set()).add(entry.key)

    def _drop(self, entry: _Entry, why: str) -> None:
        if self._entries.pop(entry.key, None) is None:
            return
        for table, h in ((self._first, int(entry.ids[0])), *((self._index, h) for h in entry.hashes)):
            holders = table.get(h)
            if holders is not None:
                holders.discard(entry.key)
                if not holders:
                    del table[h]
        if why == "evicted":
            self._stats.evictions += 1
        entry.arrays = None
        if self.directory is not None:
            if entry.writing is not None and not entry.writing.done():
                entry.writing.cancel()
            path = self._path(entry.key)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("prefix cache: cannot remove %s: %s", path, e)
        entry.on_disk = False
        log.debug("prefix cache: %s entry %016x (%d tokens)", why, entry.key, entry.tokens)

    def _held_bytes(self) -> int:
        """Bytes of the entries held in memory."""
        return sum(e.memory for e in self._entries.values() if e.arrays is not None)

    def _trim_memory(self) -> None:
        held = self._held_bytes()
        for e in list(self._entries.values()):
            if held <= self.memory_budget:
                break
            if e.arrays is None:
                continue
            if e.on_disk:
                e.arrays = None  # still answered from its file
            elif e.writing is not None and not e.writing.done():
                continue  # its file is being written: it leaves memory once written (_write)
            else:
                self._drop(e, "evicted")
            held -= e.memory

    def _trim_disk(self) -> None:
        def stored(e: _Entry) -> bool:
            return e.on_disk or (e.writing is not None and not e.writing.done())

        held = sum(e.nbytes for e in self._entries.values() if stored(e))
        for e in list(self._entries.values()):
            if held <= self.budget:
                break
            if stored(e):
                held -= e.nbytes
                self._drop(e, "evicted")

    # ---- files -----------------------------------------------------------------------
    def _path(self, key: int) -> Path:
        assert self.directory is not None
        return self.directory / f"{key:016x}{SUFFIX}"

    def _header(self, entry: _Entry, arrays: Arrays) -> tuple[bytes, list[tuple[int, np.ndarray]]]:
        specs, parts, offset = [], [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                          "nbytes": a.nbytes})
            parts.append((offset, a))
            offset = _pad(offset + a.nbytes)
        header = {"format": FORMAT, "version": VERSION, "model_id": self.model_id, "kv_identity": self.identity,
                  "block": BLOCK, "tokens": entry.tokens, "hashes": [f"{h:016x}" for h in entry.hashes],
                  "layout": self.layout, "num_layers": self.args.num_layers, "arrays": specs}
        if self.extra:
            header["extra"] = self.extra
        if self.state:
            header["state"] = self.state
            header["states"] = sorted(entry.states or ())
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return raw + b"\0" * (_pad(_PRE.size + len(raw)) - _PRE.size - len(raw)), parts

    def _write(self, entry: _Entry) -> None:
        assert self.directory is not None
        with self._lock:  # waiting keeps the entry in memory: only within the memory budget
            held = self._held_bytes()
        deadline = time.monotonic() + (WRITE_DEFER_S if held <= self.memory_budget else 0.0)
        self._quiet.wait(max(0.0, deadline - time.monotonic()))
        arrays = entry.arrays
        if arrays is None:
            return  # dropped before its turn
        header, parts = self._header(entry, arrays)
        plen = _pad(parts[-1][0] + parts[-1][1].nbytes)
        h = xxhash.xxh3_64()
        h.update(header)
        pieces: list[bytes | memoryview] = []
        pos = 0
        for offset, a in parts:
            if offset > pos:
                pieces.append(bytes(offset - pos))
            pieces.append(memoryview(a.view(np.uint8).reshape(-1)))  # type: ignore[arg-type]
            pos = offset + a.nbytes
        pieces.append(bytes(plen - pos))
        final = self._path(entry.key)
        tmp = self.directory / f".{final.name}.{os.getpid()}.{next(self._tmp)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_PRE.pack(MAGIC, len(header), plen, 0))  # the checksum once the payload is written
                f.write(header)
                for piece in pieces:  # array by array, each in a quiet moment (until the deadline)
                    self._quiet.wait(max(0.0, deadline - time.monotonic()))
                    h.update(piece)
                    f.write(piece)
                f.seek(0)
                f.write(_PRE.pack(MAGIC, len(header), plen, h.intdigest()))
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                if self._entries.get(entry.key) is not entry:
                    tmp.unlink(missing_ok=True)  # dropped while being written
                    return
                os.replace(tmp, final)
                entry.on_disk = True
                self._stats.files_written += 1
                self._trim_memory()
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            with self._lock:
                self._stats.write_errors += 1
                entry.writing = None  # no file: held in memory within its budget, or dropped
                if self._entries.get(entry.key) is entry:
                    self._trim_memory()
            log.warning("prefix cache: writing %s failed: %s", final, e)
            tmp.unlink(missing_ok=True)

    def _reject(self, path: Path, why: str) -> None:
        with self._lock:
            self._stats.files_rejected += 1
        log.warning("prefix cache: ignoring %s: %s (removed)", path, why)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def _read_header(self, path: Path) -> tuple[dict[str, Any], bytes, int, int, int]:
        """(header, raw header bytes, payload length, checksum, file size) or FormatError."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            pre = f.read(_PRE.size)
            if len(pre) != _PRE.size:
                raise FormatError(f"{size} bytes, shorter than the {_PRE.size}-byte preamble")
            magic, hlen, plen, checksum = _PRE.unpack(pre)
            if magic != MAGIC:
                raise FormatError(f"magic {magic!r} is not {MAGIC!r}")
            if size != _PRE.size + hlen + plen:
                raise FormatError(f"{size} bytes where the preamble says {_PRE.size + hlen + plen} (torn write?)")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.rstrip(b"\0"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object")
        if header.get("format") != FORMAT or header.get("version") not in READABLE:
            raise FormatError(f"format {header.get('format')!r} version {header.get('version')!r} is not "
                              f"{FORMAT!r} version {' or '.join(map(str, READABLE))}")
        if header.get("model_id") != self.model_id or header.get("kv_identity") != self.identity:
            raise _Foreign(f"KV of model {header.get('model_id')!r} ({header.get('kv_identity')!r})")
        want = {"block": BLOCK, "layout": self.layout, "num_layers": self.args.num_layers,
                "extra": self.extra or None, "state": self.state or None}
        for k, v in want.items():
            if header.get(k) != v:
                raise FormatError(f"header {k} is {header.get(k)!r}, this model needs {v!r}")
        return header, raw, plen, checksum, size

    def _scan(self) -> None:
        """Index the files of a previous run (headers only; payloads are checked when read)."""
        assert self.directory is not None
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                # an interrupted write (a young one may be another worker's, sharing the directory)
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > STALE_TMP_S:
                        path.unlink()
                continue
            if path.suffix != SUFFIX:
                continue
            if path.is_symlink():  # never read through a link out of the cache directory
                self._reject(path, "a symbolic link")
                continue
            try:
                header, raw, plen, _, _ = self._read_header(path)
            except _Foreign as e:
                log.info("prefix cache: skipping %s: %s, not this worker's", path, e)
                continue
            except (FormatError, OSError) as e:
                self._reject(path, str(e))
                continue
            try:
                entry = self._scanned(path, header, _PRE.size + len(raw), plen)
            except (FormatError, OSError, KeyError, TypeError, ValueError, ArithmeticError) as e:
                self._reject(path, str(e))  # ArithmeticError: an infinite count, a hash beyond 64 bits
                continue
            found.append((path.stat().st_mtime, entry))
        with self._lock:
            for _, entry in sorted(found, key=lambda x: x[0]):  # oldest first = least recently used
                if entry.key not in self._entries:
                    self._add(entry)
            self._trim_disk()
        if found:
            log.info("prefix cache: %d entries (%d tokens) from %s", len(self._entries),
                     sum(e.tokens for e in self._entries.values()), self.directory)

    def _scanned(self, path: Path, header: dict[str, Any], start: int, plen: int) -> _Entry:
        """The entry a file's header describes, with its token ids read from the payload (their
        checksum is checked with the rest of the payload when the entry is first used)."""
        n = int(header["tokens"])
        hashes = [int(h, 16) for h in header["hashes"]]
        spec = {a["name"]: a for a in header["arrays"]}.get("tokens")
        if spec is None:
            raise FormatError("no token array")
        if (n < 1 or spec["dtype"] != "<i4" or spec["shape"] != [n] or int(spec["offset"]) % ALIGN
                or int(spec["offset"]) + 4 * n > plen):
            raise FormatError(f"token array {spec} does not fit {n} tokens")
        with open(path, "rb") as f:
            f.seek(start + int(spec["offset"]))
            raw = f.read(4 * n)
        if len(raw) != 4 * n:
            raise FormatError("short read of the token ids")
        ids = np.frombuffer(raw, dtype="<i4").astype(np.int32)
        key = entry_key(ids, hashes, self.model_id)
        states = self._states(header, n)
        if (block_hashes(ids, BLOCK, self.model_id) != hashes or path.name != f"{key:016x}{SUFFIX}"
                or (header["version"] == 1 and n != len(hashes) * BLOCK)):
            raise FormatError("name, hashes and token ids disagree")
        return _Entry(key, hashes, ids, plen, states, on_disk=True)

    def _states(self, header: dict[str, Any], n: int) -> frozenset[int] | None:
        """The positions a file's entry saved the state at (None for a model without one)."""
        if not self.state:
            return None
        raw = header.get("states")
        if (not isinstance(raw, list) or not raw or any(not isinstance(p, int) or not 0 < p <= n for p in raw)
                or n not in raw):
            raise FormatError(f"states {raw!r} are not positions in 1..{n} including {n}")
        return frozenset(raw)

    def _read(self, entry: _Entry) -> Arrays | None:
        """The entry's arrays from its file, verified; None (file rejected, entry dropped) if bad."""
        path = self._path(entry.key)
        try:
            header, raw, plen, checksum, _ = self._read_header(path)
            with open(path, "rb") as f:
                f.seek(_PRE.size + len(raw))
                payload = f.read(plen)
            if len(payload) != plen:
                raise FormatError("short read")
            h = xxhash.xxh3_64()
            h.update(raw)
            h.update(payload)
            if h.intdigest() != checksum:
                raise FormatError("checksum mismatch")
            arrays = self._arrays(header, payload)
            if not np.array_equal(arrays["tokens"], entry.ids):
                raise FormatError("its tokens are not the ones its header and name stand for")
            return arrays
        except (FormatError, OSError, KeyError, TypeError, ValueError, ArithmeticError) as e:
            with self._lock:
                self._drop(entry, "rejected")
            self._reject(path, str(e))
            return None

    def _arrays(self, header: dict[str, Any], payload: bytes) -> Arrays:
        n = int(header["tokens"])
        want = {"tokens": ("<i4", [n])}
        for i in range(self.args.num_layers):
            for name, shape in {**self.layout, **self.extra.get(str(i), {})}.items():
                want[f"layers.{i}.{name}"] = ("<f4", [n, *shape])
        for p in self._states(header, n) or ():
            for layer, lay in self.state.items():
                for name, shape in lay.items():
                    want[state_key(p, int(layer), name)] = ("<f4", list(shape))
        out: Arrays = {}
        for spec in header["arrays"]:
            name = spec["name"]
            w = self.windows.get(int(name.split(".")[1])) if name.startswith("layers.") else None
            if w is not None and name in want and spec["shape"][1:] == want[name][1][1:] \
                    and min(n, w) <= spec["shape"][0] <= n:
                want[name] = (want[name][0], spec["shape"])  # a sliding-window layer: its last positions
            if name not in want or (spec["dtype"], spec["shape"]) != want[name]:
                raise FormatError(f"array {name!r} is {spec['dtype']} {spec['shape']}, expected {want.get(name)}")
            dt = np.dtype(spec["dtype"])
            nbytes = int(np.prod(spec["shape"])) * dt.itemsize
            off = int(spec["offset"])
            if nbytes != spec["nbytes"] or off % ALIGN or off + nbytes > len(payload):
                raise FormatError(f"array {name!r}: offset {off} and size {nbytes} do not fit the payload")
            out[name] = np.frombuffer(payload, dtype=dt, count=nbytes // dt.itemsize, offset=off).reshape(spec["shape"])
        if set(out) != set(want):
            raise FormatError(f"arrays missing: {sorted(set(want) - set(out))[:3]}")
        return out
