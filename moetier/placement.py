"""Where each routed expert is computed when the experts are sharded across expert stores.

Each store owns a set of (layer, expert) records (`Ownership`: its configured share, less the
layer files absent from its disk) and registers it with the router together with its measured
read bandwidth. The router publishes every live store's ownership as one `PlacementMap`; each
dense worker holds a copy and sends, per MoE layer per step, one ComputeExperts to every store
that `assign` gives part of the layer's batch union.

An expert with several owners (a full copy and a shard, or overlapping shards: hot experts
held twice) goes to the owner that wins a weighted rendezvous hash of (store, layer, expert),
weights = read bandwidth, so a store's share of what it co-owns is proportional to its
bandwidth, every worker computes the same answer without talking to the others, and a store
that joins or leaves moves only the experts it wins or won. A store that fails is excluded
(`down`) and its experts go to their next owner; an expert with no live owner left is
reported, never silently dropped.

Ownership specs (settings `storage.owned_experts`): "all", or comma-separated items
`LAYERS[:EXPERTS]`, each a number or an inclusive range `a-b`: "1-9" = every expert of layers
1..9; "1-19:0-31" = experts 0..31 of layers 1..19; "3:5" = expert 5 of layer 3. Or one
shard of a layer-interleaved split, for replicas that know only their ordinal (a Kubernetes
StatefulSet's pod index): "I/N" = every N-th MoE layer from the I-th (0-based, in MoE-layer
order), "I/N*R" = shards I, I+1, ..., I+R-1 (mod N), so that N replicas hold every layer R
times and any R-1 of them may die.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from moetier.errors import InvalidArgument

ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class ExpertRange:
    """Experts [first, last) of one layer."""

    layer: int
    first: int
    last: int


def _span(text: str, what: str, spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise InvalidArgument(f"owned experts {spec!r}: {what} {text!r} is not a number or a range a-b")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a:
        raise InvalidArgument(f"owned experts {spec!r}: {what} range {text!r} is empty (end before start)")
    return a, b


def parse_owned(spec: str, moe_layers: Sequence[int], n_experts: int) -> set[ExpertKey]:
    """The (layer, expert) keys an ownership spec names, checked against the model."""
    if spec.strip().lower() in ("", "all"):
        return {(layer, e) for layer in moe_layers for e in range(n_experts)}
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*(?:\*\s*(\d+)\s*)?", spec)
    if m:
        i, n = int(m.group(1)), int(m.group(2))
        r = int(m.group(3)) if m.group(3) is not None else 1
        if not 0 <= i < n or not 1 <= r <= n:
            raise InvalidArgument(f"owned experts {spec!r}: shard I/N*R needs 0 <= I < N and 1 <= R <= N")
        if n > len(moe_layers):
            raise InvalidArgument(f"owned experts {spec!r}: {n} shards of {len(moe_layers)} MoE layers leave "
                                  "some shard empty")
        return {(layer, e) for j, layer in enumerate(moe_layers) if (j - i) % n < r for e in range(n_experts)}
    moe = set(moe_layers)
    out: set[ExpertKey] = set()
    for item in spec.split(","):
        layers_text, _, experts_text = item.partition(":")
        la, lb = _span(layers_text, "layers", spec)
        ea, eb = _span(experts_text, "experts", spec) if experts_text.strip() else (0, n_experts - 1)
        layers = [layer for layer in range(la, lb + 1) if layer in moe]
        if not layers:
            raise InvalidArgument(f"owned experts {spec!r}: {layers_text.strip()!r} names no MoE layer of the model "
                                  f"(MoE layers {moe_layers[0]}..{moe_layers[-1]})")
        if eb >= n_experts:
            raise InvalidArgument(f"owned experts {spec!r}: expert {eb} is outside [0, {n_experts})")
        out.update((layer, e) for layer in layers for e in range(ea, eb + 1))
    return out


def to_ranges(keys: Iterable[ExpertKey]) -> list[ExpertRange]:
    """Keys as the fewest [first, last) ranges, by layer then expert."""
    out: list[ExpertRange] = []
    for layer, e in sorted(keys):
        last = out[-1] if out else None
        if last is not None and last.layer == layer and last.last == e:
            out[-1] = ExpertRange(layer, last.first, e + 1)
        else:
            out.append(ExpertRange(layer, e, e + 1))
    return out


def from_ranges(ranges: Iterable[ExpertRange]) -> set[ExpertKey]:
    return {(r.layer, e) for r in ranges for e in range(r.first, r.last)}


@dataclass(frozen=True)
class StoreEntry:
    """One live store of the map."""

    member_id: str
    address: str
    weight: float  # > 0
    owned: tuple[ExpertRange, ...]  # empty: every expert


def _score(member_id: str, key: ExpertKey, weight: float) -> float:
    """Weighted rendezvous: the owner with the smallest -ln(u)/w wins, P(win) = w / sum(w)."""
    h = xxhash.xxh3_64_intdigest(f"{member_id}/{key[0]}/{key[1]}".encode())
    return -math.log((h + 0.5) / 2.0**64) / weight


class PlacementMap:
    """The stores and what each owns; which of them computes each expert."""

    def __init__(self, stores: Sequence[StoreEntry], version: int = 0) -> None:
        self.version = version
        self.stores = sorted(stores, key=lambda s: s.member_id)
        self._all = [i for i, s in enumerate(self.stores) if not s.owned]  # stores holding every expert
        self._owners: dict[ExpertKey, list[int]] = {}  # key -> stores owning it (beyond `_all`)
        for i, s in enumerate(self.stores):
            for key in from_ranges(s.owned):
                self._owners.setdefault(key, []).append(i)
        self._ranked: dict[ExpertKey, list[int]] = {}

    @staticmethod
    def weighted(stores: Sequence[tuple[str, str, float, Sequence[ExpertRange]]], version: int = 0) -> PlacementMap:
        """A map from (member_id, address, bandwidth, owned); an unknown bandwidth (<= 0) weighs as
        the mean of the known ones (1.0 when none is known)."""
        known = [bw for _, _, bw, _ in stores if bw > 0]
        mean = sum(known) / len(known) if known else 1.0
        return PlacementMap([StoreEntry(m, a, bw if bw > 0 else mean, tuple(o)) for m, a, bw, o in stores], version)

    def __len__(self) -> int:
        return len(self.stores)

    def owners(self, key: ExpertKey) -> list[int]:
        """Indexes into `stores` of the key's owners, the preferred first (cached)."""
        ranked = self._ranked.get(key)
        if ranked is None:
            cands = self._all + self._owners.get(key, [])
            ranked = sorted(cands, key=lambda i: (_score(self.stores[i].member_id, key, self.stores[i].weight), i))
            self._ranked[key] = ranked
        return ranked

    def owner(self, key: ExpertKey, down: frozenset[str] = frozenset()) -> int | None:
        for i in self.owners(key):
            if self.stores[i].member_id not in down:
                return i
        return None

    def assign(self, layer: int, experts: Iterable[int],
               down: frozenset[str] = frozenset()) -> tuple[dict[int, list[int]], list[int]]:
        """({store index: its experts}, experts with no live owner) for one layer's union."""
        out: dict[int, list[int]] = {}
        missing: list[int] = []
        for e in experts:
            i = self.owner((layer, int(e)), down)
            if i is None:
                missing.append(int(e))
            else:
                out.setdefault(i, []).append(int(e))
        return out, missing

    def placed(self, moe_layers: Sequence[int], n_experts: int) -> dict[str, int]:
        """member_id -> experts the map sends to it first (none down), over the whole model."""
        counts = {s.member_id: 0 for s in self.stores}
        for layer in moe_layers:
            for e in range(n_experts):
                i = self.owner((layer, e))
                if i is not None:
                    counts[self.stores[i].member_id] += 1
        return counts

    def unowned(self, moe_layers: Sequence[int], n_experts: int) -> int:
        """Experts of the model no store owns."""
        if self._all:
            return 0
        return sum(1 for layer in moe_layers for e in range(n_experts) if (layer, e) not in self._owners)
