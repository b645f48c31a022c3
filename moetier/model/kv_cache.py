"""Per-sequence KV cache: what attention keeps of every past position, per layer.

Legend: S = cached positions, L = layers, Hkv = key/value heads, hd = head dim,
W = floats per position per layer (ModelArgs.kv_cache_width).

Layouts (per layer):
  GQA: k [S, Hkv, hd], v [S, Hkv, hd]  -- after qk-norm, clipping and rope
  MLA: latent [S, kv_lora + rope]      -- [normalised c_kv | roped shared key k_pe]; the
       keys of absorbed attention are the whole row, the values its first kv_lora floats
  DSA: index_k [S, Di] besides, in the layers that run their own lightning indexer
       (ModelArgs.indexer_layers) -- the indexer's layer-normed, roped key
  Hybrid (Qwen3-Next): GQA k/v in the full-attention layers only; a Gated DeltaNet layer keeps
       no per-position arrays but a fixed-size state (`cache_state`): ssm [Hv, dk, dv] (the
       recurrent state) and conv [Kc - 1, C] (the last Kc - 1 inputs of its convolution)

Recurrent state. The state is that of the committed positions [0, length); a step writes the
new state with `put_state` and it replaces the old one at `commit`. It cannot be cut back to
an earlier position, so the cache also keeps snapshots: the state at the positions in
`save_at`, which the linear layers copy as their token loop passes them (no extra compute),
and the state it was rebuilt with. `truncate(n)` below `length` needs a snapshot at n (or
n = 0); `state_positions` lists where this cache can resume (what the prefix cache may serve).

A step writes its new positions at [length, length + n) of every layer and only then
`commit`s them, so a step that fails half-way leaves the cache as it was.
The arrays grow by doubling; `to_arrays`/`from_arrays` carry exactly the committed positions
(plus the token ids that produced them) for the prefix cache.

Sliding-window layers (gpt-oss: ModelArgs.window(i) = W > 0) keep only their latest
positions: their arrays hold positions [start(i), length), and once they hold 2 * KEEP
of them the oldest are dropped, keeping KEEP = W + ROLLBACK (the window of the next
query, plus a few positions a rollback may return to). Row j of such an array is position
start(i) + j; `get` returns the rows, `start` says where they begin. A cache can be
truncated, and a persisted one resumed, only to a length whose window it still holds
(`min_length`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs

F32 = npt.NDArray[np.float32]
Layout = dict[str, tuple[int, ...]]  # array name -> per-position shape

MIN_CAPACITY = 16
ROLLBACK = 16  # positions a sliding-window layer keeps beyond its window (speculative rollback)


def _grown(have: int, need: int, expect: int = 0) -> int:
    """The capacity that replaces `have` positions when `need` do not fit: a quarter more (at
    least `need`), in whole MIN_CAPACITY blocks. Doubling kept up to twice what a sequence uses
    (a 1025-position sequence held 2048 positions); a quarter keeps the copies amortised. Where
    the sequence is expected to reach `expect` positions (KVCache.expect) and `need` is within
    that, it doubles up to `expect`: fewer growths, each a copy of every array into fresh memory,
    and never more room than the sequence is expected to use."""
    want = max(need, have + have // 4, MIN_CAPACITY)
    if need <= expect:
        want = max(want, min(2 * have, expect))
    return -(-want // MIN_CAPACITY) * MIN_CAPACITY


def cache_layout(args: ModelArgs) -> Layout:
    """The arrays every layer keeps (none in a hybrid model: its full layers' k/v are `cache_extra`)."""
    if any(args.linear_layers):
        return {}
    if args.attention == "mla":
        return {"latent": (args.kv_lora_rank + args.qk_rope_head_dim,)}
    return {"k": (args.num_kv_heads, args.head_dim), "v": (args.num_kv_heads, args.head_dim)}


def cache_extra(args: ModelArgs) -> dict[int, Layout]:
    """Arrays only some layers keep: layer -> their layout (the DSA indexer keys; the k/v of a
    hybrid model's full-attention layers)."""
    if any(args.linear_layers):
        kv = (args.num_kv_heads, args.head_dim)
        return {i: {"k": kv, "v": kv} for i, lin in enumerate(args.linear_layers) if not lin}
    if not args.index_topk:
        return {}
    return {i: {"index_k": (args.index_head_dim,)} for i, full in enumerate(args.indexer_layers) if full}


def cache_state(args: ModelArgs) -> dict[int, Layout]:
    """Fixed-size per-sequence state: layer -> its arrays' shapes (the Gated DeltaNet layers)."""
    ssm = (args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
    conv = (args.linear_conv_kernel - 1, args.linear_conv_dim)
    return {i: {"conv": conv, "ssm": ssm} for i, lin in enumerate(args.linear_layers) if lin}


def cache_windows(args: ModelArgs) -> dict[int, int]:
    """Sliding-window layers: layer -> W (the positions it attends to)."""
    return {i: args.window(i) for i in range(args.num_layers) if args.window(i)}


def state_key(pos: int, layer: int, name: str) -> str:
    """Name of a state snapshot array in `to_arrays`: the state of positions [0, pos)."""
    return f"state.{pos}.layers.{layer}.{name}"


class KVCache:
    def __init__(self, layout: Mapping[str, tuple[int, ...]], num_layers: int,
                 extra: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
                 state: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
                 windows: Mapping[int, int] | None = None) -> None:
        self.layout: Layout = {k: tuple(v) for k, v in layout.items()}
        self.extra: dict[int, Layout] = {int(i): {k: tuple(v) for k, v in lay.items()}
                                         for i, lay in sorted((extra or {}).items())}
        self.state_layout: dict[int, Layout] = {int(i): {k: tuple(v) for k, v in lay.items()}
                                                for i, lay in sorted((state or {}).items())}
        self.windows: dict[int, int] = {int(i): int(w) for i, w in sorted((windows or {}).items())}
        if any(not 0 <= i < num_layers for i in [*self.extra, *self.state_layout, *self.windows]):
            raise ValueError(f"extra KV arrays for layers {sorted(self.extra)}, state for "
                             f"{sorted(self.state_layout)} and windows for {sorted(self.windows)} of a "
                             f"{num_layers}-layer cache")
        if any(w <= 0 for w in self.windows.values()):
            raise ValueError(f"sliding windows must be > 0, got {self.windows}")
        self.num_layers = num_layers
        self._start = [0] * num_layers  # the position of each layer's row 0 (0 but in sliding-window layers)
        self._state: dict[tuple[int, str], F32] = self._zero_state()  # the state of [0, length)
        self._pending: dict[tuple[int, str], F32] = {}  # written by the step in flight
        self._snaps: dict[int, dict[tuple[int, str], F32]] = {}  # position -> the state of [0, position)
        self._pending_snaps: dict[int, dict[tuple[int, str], F32]] = {}
        self.save_at: set[int] = set()  # positions whose state the linear layers snapshot as they pass
        self.length = 0  # committed positions
        self.expected = 0  # positions the sequence is expected to reach (see `expect`)
        self._tokens = np.zeros(0, dtype=np.int32)
        self._arrays: list[dict[str, F32]] = [
            {name: np.zeros((0, *shape), dtype=np.float32) for name, shape in self.layer_layout(i).items()}
            for i in range(num_layers)
        ]
        self._caps = [self._count_capacity(i) for i in range(num_layers)]  # kept with _arrays (see _capacity)

    @classmethod
    def for_model(cls, args: ModelArgs) -> KVCache:
        return cls(cache_layout(args), args.num_layers, cache_extra(args), cache_state(args), cache_windows(args))

    def start(self, layer: int) -> int:
        """The first position layer `layer` still holds (0 unless it is a sliding-window layer)."""
        return self._start[layer]

    @property
    def min_length(self) -> int:
        """The shortest length this cache can be truncated to: every sliding-window layer must
        still hold the window of the position that comes next."""
        return max([s + self.windows[i] - 1 for i, s in enumerate(self._start) if s > 0], default=0)

    def _rows(self, layer: int) -> int:
        return self.length - self._start[layer]

    def _capacity(self, layer: int) -> int | None:
        """Rows layer `layer`'s arrays have room for (None: it keeps no per-position arrays).
        Counted whenever they are replaced: reserve and commit ask for every layer each step."""
        return self._caps[layer]

    def _count_capacity(self, layer: int) -> int | None:
        return min((int(a.shape[0]) for a in self._arrays[layer].values()), default=None)

    def _layer_floats(self, layer: int) -> int:
        """Floats a position of layer `layer` keeps (its layout's, fixed: counted once)."""
        floats = self.__dict__.get("_floats")
        if floats is None:
            floats = self.__dict__["_floats"] = [sum(int(np.prod(s)) for s in self.layer_layout(i).values())
                                                 for i in range(self.num_layers)]
        return int(floats[layer])

    def _zero_state(self) -> dict[tuple[int, str], F32]:
        return {(i, n): np.zeros(shape, dtype=np.float32) for i, lay in self.state_layout.items()
                for n, shape in lay.items()}

    def layer_layout(self, layer: int) -> Layout:
        """Every array layer `layer` keeps: the common layout plus its extra arrays."""
        return {**self.layout, **self.extra.get(layer, {})}

    def same_shape(self, other: KVCache) -> bool:
        return ((self.layout, self.extra, self.state_layout, self.windows, self.num_layers)
                == (other.layout, other.extra, other.state_layout, other.windows, other.num_layers))

    # ---- size ---------------------------------------------------------------------
    @property
    def width(self) -> int:
        """W: floats per position of every layer (the common layout)."""
        return sum(int(np.prod(s)) for s in self.layout.values())

    @property
    def position_floats(self) -> int:
        """Floats per position over all layers, extra arrays included."""
        extra = sum(int(np.prod(s)) for lay in self.extra.values() for s in lay.values())
        return self.num_layers * self.width + extra

    @property
    def capacity(self) -> int:
        return len(self._tokens)

    @property
    def state_floats(self) -> int:
        """Floats of one copy of the fixed-size state (0 without linear layers)."""
        return sum(int(np.prod(s)) for lay in self.state_layout.values() for s in lay.values())

    @property
    def state_positions(self) -> list[int]:
        """Where this cache can resume (`truncate`): every position without a fixed-size state,
        else the snapshots' positions and `length` (the current state), ascending."""
        if not self.state_layout:
            return list(range(self.length + 1))
        return sorted({p for p in self._snaps if p <= self.length} | {self.length})

    @property
    def nbytes(self) -> int:
        """Bytes of the committed positions and of the states `to_arrays` holds (what persisting
        this cache costs)."""
        states = len(self.state_positions) if self.state_layout else 0
        rows = sum(self._rows(i) * self._layer_floats(i) for i in range(self.num_layers))  # a sliding layer: its kept rows
        return 4 * (rows + states * self.state_floats)

    @property
    def capacity_bytes(self) -> int:
        """Bytes the arrays hold in memory (capacity, not just the committed positions; the
        current state and every snapshot)."""
        rows = sum((self._capacity(i) or 0) * self._layer_floats(i) for i in range(self.num_layers))
        return 4 * (rows + (1 + len(self._snaps)) * self.state_floats)

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """Token ids of the committed positions [S]."""
        return self._tokens[: self.length]

    def expect(self, positions: int) -> None:
        """The sequence is expected to reach `positions` positions (its prompt and the tokens it
        may generate): growing the arrays doubles up to that instead of a quarter at a time (see
        `_grown`). Changes no value, only how often the arrays are copied."""
        self.expected = max(0, int(positions))

    # ---- the step protocol: reserve -> put/get per layer -> commit -----------------
    def reserve(self, n: int) -> int:
        """Make room for n more positions; returns where they start (= length). A step starts
        here: what a failed step before it wrote of the state is forgotten."""
        self._pending, self._pending_snaps = {}, {}
        for i, layer in enumerate(self._arrays):
            rows, have = self._rows(i), self._capacity(i)
            if have is not None and rows + n > have:
                cap = _grown(have, rows + n, 0 if i in self.windows else self.expected - self._start[i])
                for name, a in layer.items():
                    grown = np.zeros((cap, *a.shape[1:]), dtype=np.float32)
                    grown[:rows] = a[:rows]
                    layer[name] = grown
                self._caps[i] = self._count_capacity(i)
        need = self.length + n
        if need > self.capacity:
            tokens = np.zeros(_grown(self.capacity, need, self.expected), dtype=np.int32)
            tokens[: self.length] = self._tokens[: self.length]
            self._tokens = tokens
        return self.length

    def state(self, layer: int, name: str) -> F32:
        """The committed state of one linear layer's array (read-only by convention)."""
        return self._state[(layer, name)]

    def put_state(self, layer: int, name: str, value: F32) -> None:
        """The state after this step's positions; it replaces the current one at `commit`."""
        self._pending[(layer, name)] = value

    def snapshot(self, pos: int, layer: int, name: str, value: F32) -> None:
        """The state of positions [0, pos), passed during this step (kept at `commit`)."""
        self._pending_snaps.setdefault(pos, {})[(layer, name)] = value.copy()

    def put(self, layer: int, name: str, start: int, values: F32) -> None:
        """Write positions [start, start + len(values)) of one layer's array."""
        r = start - self._start[layer]
        self._arrays[layer][name][r : r + len(values)] = values

    def get(self, layer: int, name: str, end: int) -> F32:
        """Positions [start(layer), end) of one layer's array (a view, C-contiguous)."""
        return self._arrays[layer][name][: end - self._start[layer]]

    def commit(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """The positions written since `reserve` become part of the sequence."""
        t = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if self.length + len(t) > self.capacity or any(
                (c := self._capacity(i)) is not None and self._rows(i) + len(t) > c for i in range(self.num_layers)):
            raise ValueError(f"commit of {len(t)} positions without reserve (capacity {self.capacity})")
        self._tokens[self.length : self.length + len(t)] = t
        self.length += len(t)
        if self.state_layout:
            if set(self._pending) != set(self._state):
                raise ValueError(f"commit without the state of every linear layer ({len(self._pending)} of "
                                 f"{len(self._state)} arrays written)")
            self._state, self._pending = self._pending, {}
            for pos, snap in self._pending_snaps.items():
                if len(snap) == len(self._state):
                    self._snaps[pos] = snap
            self._pending_snaps = {}
        self._slide()

    def _slide(self) -> None:
        """Sliding-window layers drop their oldest positions once they hold 2 * KEEP (see the
        module docstring): a copy of KEEP rows every KEEP positions."""
        for i, w in self.windows.items():
            keep = w + ROLLBACK
            if self._rows(i) >= 2 * keep:
                drop = self._rows(i) - keep
                for a in self._arrays[i].values():
                    a[:keep] = a[drop : drop + keep].copy()
                self._start[i] += drop

    def truncate(self, n: int) -> None:
        """Keep the first n positions (prefix reuse, rollback). With a fixed-size state, n below
        `length` must be a saved position (`state_positions`, or 0)."""
        if n < 0:
            raise ValueError(f"cannot truncate to {n} positions")
        if n >= self.length:
            return
        if n < self.min_length:
            raise ValueError(f"cannot truncate to {n} positions: the sliding-window layers keep positions "
                             f"from {min(s for s in self._start if s)} on, so {self.min_length} is the shortest")
        if self.state_layout:
            if n == 0:
                self._state = self._zero_state()
            elif n in self._snaps:
                self._state = {k: v.copy() for k, v in self._snaps[n].items()}
            else:
                raise ValueError(f"no recurrent state saved at position {n} (saved: {self.state_positions})")
            self._snaps = {p: s for p, s in self._snaps.items() if p <= n}
        self.length = n

    # ---- persistence ---------------------------------------------------------------
    def to_arrays(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """{"tokens": int32 [S], "layers.{i}.{name}": float32 [S, ...]} (a sliding-window layer's
        hold its last positions only, [S - start(i), ...]), and with a fixed-size state, for every
        position p of `state_positions`, "state.{p}.layers.{i}.{name}". Copies, or with copy=False
        views of this cache's own arrays (they keep its whole capacity alive, `capacity_bytes`):
        for a cache that is never written again, such as a finished sequence's handed to the
        prefix cache, which then needs no second copy of its KV."""
        keep: Callable[[np.ndarray], np.ndarray] = np.copy if copy else (lambda a: a)
        out: dict[str, np.ndarray] = {"tokens": keep(self.tokens)}
        for i, layer in enumerate(self._arrays):
            for name, a in layer.items():
                out[f"layers.{i}.{name}"] = keep(a[: self._rows(i)])
        if self.state_layout:
            for p in self.state_positions:
                snap = self._state if p == self.length else self._snaps[p]
                for (i, name), a in snap.items():
                    out[state_key(p, i, name)] = keep(a)
        return out

    @classmethod
    def from_arrays(cls, args: ModelArgs, arrays: Mapping[str, np.ndarray], length: int | None = None) -> KVCache:
        """Rebuild a cache of `args`'s layout, of its first `length` positions (default: all; a
        sliding-window layer must still hold the window of `length`, a fixed-size state needs a
        snapshot there); raises ValueError naming the first bad array or why it cannot resume."""
        cache = cls.for_model(args)
        if "tokens" not in arrays:
            raise ValueError("KV cache arrays lack 'tokens'")
        tokens = np.asarray(arrays["tokens"])
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"KV cache 'tokens' must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        s = len(tokens)
        n = s if length is None else int(length)
        if not 0 <= n <= s:
            raise ValueError(f"KV cache of {s} positions cannot give its first {n}")
        expected = {f"layers.{i}.{name}" for i in range(args.num_layers) for name in cache.layer_layout(i)}
        states = cache._states_from(arrays, n)
        extra = set(arrays) - expected - {"tokens"} - {k for k in arrays if k.startswith("state.")}
        if extra:
            raise ValueError(f"KV cache arrays hold unknown entries: {sorted(extra)[:5]}")
        starts = [0] * args.num_layers
        for i in range(args.num_layers):
            w = cache.windows.get(i)
            for name, shape in cache.layer_layout(i).items():
                key = f"layers.{i}.{name}"
                if key not in arrays:
                    raise ValueError(f"KV cache arrays lack {key!r}")
                a = np.asarray(arrays[key])
                rows_ok = a.shape[0] == s if w is None else min(s, w) <= a.shape[0] <= s
                if a.shape[1:] != shape or not rows_ok:
                    raise ValueError(f"KV cache array {key!r} has shape {a.shape}, expected {(s, *shape)}"
                                     + ("" if w is None else f" (or at least the last {min(s, w)} positions)"))
                starts[i] = s - a.shape[0]
            if w is not None and starts[i] > 0 and n < starts[i] + w - 1:
                raise ValueError(f"KV cache layer {i} keeps positions {starts[i]}..{s - 1}: it cannot resume at "
                                 f"{n} (its window of {w} needs positions from {n - w + 1})")
        if cache.state_layout and n and n not in states:
            raise ValueError(f"no recurrent state saved at position {n} (saved: {sorted(states)})")
        for i in range(args.num_layers):
            for name in cache.layer_layout(i):
                rows = np.asarray(arrays[f"layers.{i}.{name}"])[: n - starts[i]]
                cache._arrays[i][name] = np.array(rows, dtype=np.float32)  # a copy of the positions kept
            cache._caps[i] = cache._count_capacity(i)
        cache._start = starts
        cache._tokens = np.array(tokens[:n], dtype=np.int32)
        cache.length = n
        if cache.state_layout:
            cache._state = dict(states.pop(n)) if n else cache._zero_state()
            cache._snaps = {**states, n: {k: v.copy() for k, v in cache._state.items()}} if n else states
        return cache

    def _states_from(self, arrays: Mapping[str, np.ndarray], s: int) -> dict[int, dict[tuple[int, str], F32]]:
        """The state snapshots among `arrays` at positions <= s, checked: position -> state."""
        found: dict[int, dict[tuple[int, str], F32]] = {}
        for key, a in arrays.items():
            if not key.startswith("state."):
                continue
            parts = key.split(".")
            if len(parts) != 5 or parts[2] != "layers" or not parts[1].isdigit() or not parts[3].isdigit():
                raise ValueError(f"KV cache array {key!r} is not a state snapshot name")
            pos, layer, name = int(parts[1]), int(parts[3]), parts[4]
            shape = self.state_layout.get(layer, {}).get(name)
            if shape is None:
                raise ValueError(f"KV cache arrays hold unknown state {key!r}")
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"KV cache state {key!r} has shape {a.shape}, expected {shape}")
            if pos <= s:
                found.setdefault(pos, {})[(layer, name)] = np.array(a, dtype=np.float32)
        for pos, snap in found.items():
            if len(snap) != len(self._state):
                raise ValueError(f"KV cache state at position {pos} is incomplete ({len(snap)} of "
                                 f"{len(self._state)} arrays)")
        if self.state_layout and s and s not in found:
            raise ValueError(f"KV cache arrays of {s} positions lack the recurrent state at {s}")
        return found
