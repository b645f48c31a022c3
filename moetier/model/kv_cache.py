"""Per-sequence KV cache: what attention keeps of every past position, per layer.

Legend: S = cached positions, L = layers, Hkv = key/value heads, hd = head dim,
W = floats per position per layer (ModelArgs.kv_cache_width).

Layouts (per layer):
  GQA: k [S, Hkv, hd], v [S, Hkv, hd]  -- after qk-norm, clipping and rope
  MLA: latent [S, kv_lora + rope]      -- [normalised c_kv | roped shared key k_pe]; the
       keys of absorbed attention are the whole row, the values its first kv_lora floats
  DSA: index_k [S, Di] besides, in the layers that run their own lightning indexer
       (ModelArgs.indexer_layers) -- the indexer's layer-normed, roped key

A step writes its new positions at [length, length + n) of every layer and only then
`commit`s them, so a step that fails half-way leaves the cache as it was.
The arrays grow by doubling; `to_arrays`/`from_arrays` carry exactly the committed positions
(plus the token ids that produced them) for the prefix cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from moetier.model.config import ModelArgs

F32 = npt.NDArray[np.float32]
Layout = dict[str, tuple[int, ...]]  # array name -> per-position shape

MIN_CAPACITY = 16


def cache_layout(args: ModelArgs) -> Layout:
    """The arrays every layer keeps."""
    if args.attention == "mla":
        return {"latent": (args.kv_lora_rank + args.qk_rope_head_dim,)}
    return {"k": (args.num_kv_heads, args.head_dim), "v": (args.num_kv_heads, args.head_dim)}


def cache_extra(args: ModelArgs) -> dict[int, Layout]:
    """Arrays only some layers keep: layer -> their layout (the DSA indexer keys)."""
    if not args.index_topk:
        return {}
    return {i: {"index_k": (args.index_head_dim,)} for i, full in enumerate(args.indexer_layers) if full}


class KVCache:
    def __init__(self, layout: Mapping[str, tuple[int, ...]], num_layers: int,
                 extra: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None) -> None:
        self.layout: Layout = {k: tuple(v) for k, v in layout.items()}
        self.extra: dict[int, Layout] = {int(i): {k: tuple(v) for k, v in lay.items()}
                                         for i, lay in sorted((extra or {}).items())}
        if any(not 0 <= i < num_layers for i in self.extra):
            raise ValueError(f"extra KV arrays for layers {sorted(self.extra)} of a {num_layers}-layer cache")
        self.num_layers = num_layers
        self.length = 0  # committed positions
        self._tokens = np.zeros(0, dtype=np.int32)
        self._arrays: list[dict[str, F32]] = [
            {name: np.zeros((0, *shape), dtype=np.float32) for name, shape in self.layer_layout(i).items()}
            for i in range(num_layers)
        ]

    @classmethod
    def for_model(cls, args: ModelArgs) -> KVCache:
        return cls(cache_layout(args), args.num_layers, cache_extra(args))

    def layer_layout(self, layer: int) -> Layout:
        """Every array layer `layer` keeps: the common layout plus its extra arrays."""
        return {**self.layout, **self.extra.get(layer, {})}

    def same_shape(self, other: KVCache) -> bool:
        return (self.layout, self.extra, self.num_layers) == (other.layout, other.extra, other.num_layers)

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
        return int(self._arrays[0][next(iter(self.layout))].shape[0]) if self.num_layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the committed positions (what persisting this cache costs)."""
        return 4 * self.length * self.position_floats

    @property
    def capacity_bytes(self) -> int:
        """Bytes the arrays hold in memory (capacity, not just the committed positions)."""
        return 4 * self.capacity * self.position_floats

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """Token ids of the committed positions [S]."""
        return self._tokens[: self.length]

    # ---- the step protocol: reserve -> put/get per layer -> commit -----------------
    def reserve(self, n: int) -> int:
        """Make room for n more positions; returns where they start (= length)."""
        need = self.length + n
        if need > self.capacity:
            cap = max(need, 2 * self.capacity, MIN_CAPACITY)
            for layer in self._arrays:
                for name, a in layer.items():
                    grown = np.zeros((cap, *a.shape[1:]), dtype=np.float32)
                    grown[: self.length] = a[: self.length]
                    layer[name] = grown
            tokens = np.zeros(cap, dtype=np.int32)
            tokens[: self.length] = self._tokens[: self.length]
            self._tokens = tokens
        return self.length

    def put(self, layer: int, name: str, start: int, values: F32) -> None:
        """Write positions [start, start + len(values)) of one layer's array."""
        self._arrays[layer][name][start : start + len(values)] = values

    def get(self, layer: int, name: str, end: int) -> F32:
        """Positions [0, end) of one layer's array (a view, C-contiguous)."""
        return self._arrays[layer][name][:end]

    def commit(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """The positions written since `reserve` become part of the sequence."""
        t = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if self.length + len(t) > self.capacity:
            raise ValueError(f"commit of {len(t)} positions without reserve (capacity {self.capacity})")
        self._tokens[self.length : self.length + len(t)] = t
        self.length += len(t)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (prefix reuse, rollback)."""
        if n < 0:
            raise ValueError(f"cannot truncate to {n} positions")
        self.length = min(self.length, n)

    # ---- persistence ---------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """{"tokens": int32 [S], "layers.{i}.{name}": float32 [S, ...]} (copies)."""
        out: dict[str, np.ndarray] = {"tokens": self.tokens.copy()}
        for i, layer in enumerate(self._arrays):
            for name, a in layer.items():
                out[f"layers.{i}.{name}"] = a[: self.length].copy()
        return out

    @classmethod
    def from_arrays(cls, args: ModelArgs, arrays: Mapping[str, np.ndarray]) -> KVCache:
        """Rebuild a cache of `args`'s layout; raises ValueError naming the first bad array."""
        cache = cls.for_model(args)
        if "tokens" not in arrays:
            raise ValueError("KV cache arrays lack 'tokens'")
        tokens = np.asarray(arrays["tokens"])
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"KV cache 'tokens' must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        s = len(tokens)
        expected = {f"layers.{i}.{name}" for i in range(args.num_layers) for name in cache.layer_layout(i)}
        extra = set(arrays) - expected - {"tokens"}
        if extra:
            raise ValueError(f"KV cache arrays hold unknown entries: {sorted(extra)[:5]}")
        cache.reserve(s)
        for i in range(args.num_layers):
            for name, shape in cache.layer_layout(i).items():
                key = f"layers.{i}.{name}"
                if key not in arrays:
                    raise ValueError(f"KV cache arrays lack {key!r}")
                a = np.asarray(arrays[key])
                if a.shape != (s, *shape):
                    raise ValueError(f"KV cache array {key!r} has shape {a.shape}, expected {(s, *shape)}")
                cache.put(i, name, 0, a.astype(np.float32, copy=False))
        cache.commit(tokens)
        return cache
