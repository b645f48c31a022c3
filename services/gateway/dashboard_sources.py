"""Where the dashboard's cluster data comes from: the router's ClusterStatus names the
expert stores (address, metrics address); each store's `Heat` RPC gives the per-expert
snapshot, and its /metrics the hit and miss counters. Protobuf stops here: callers get
plain dataclasses. Every call carries a deadline; an unreachable store is reported, not
raised, so the page can say what is missing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from moetier.errors import MoetierError
from moetier.rpc.tensors import from_pb
from moetier.rpc.v1 import expert_store_pb2, expert_store_pb2_grpc, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

# The store's demand counters (services/expert_store/metrics.py); hit rate = hits / (hits + misses).
HITS_METRIC = "moetier_expert_store_hits"
MISSES_METRIC = "moetier_expert_store_misses"


@dataclass(frozen=True)
class StoreRef:
    """An expert store as the router lists it."""

    member_id: str
    address: str  # gRPC host:port
    metrics_address: str  # host:port of /metrics ("" when it serves none)
    placed_experts: int = 0  # experts the router's placement map sends to it first


@dataclass
class StoreHeat:
    """One store's Heat snapshot, or why there is none."""

    store: StoreRef
    error: str | None = None
    layers: list[int] = field(default_factory=list)  # MoE layer ids, the rows of the arrays
    n_experts: int = 0  # E: columns
    counts: list[int] = field(default_factory=list)  # [L * E] row-major: times routed since start
    tier: list[int] = field(default_factory=list)  # [L * E]: 0 RAM, 1 + d only on disks[d], 255 not held
    recent: list[int] = field(default_factory=list)  # [L * E]: 1 = routed in the layer's latest call
    disks: list[str] = field(default_factory=list)
    resident_bytes: int = 0
    budget_bytes: int = 0
    step: int = 0

    def to_dict(self) -> dict[str, object]:
        experts_per_tier = [0] * (1 + len(self.disks))
        held = 0
        for t in self.tier:
            if 0 <= t < len(experts_per_tier):
                experts_per_tier[t] += 1
                held += 1
        return {"id": self.store.member_id, "address": self.store.address, "error": self.error,
                "layers": self.layers, "n_experts": self.n_experts, "step": self.step, "disks": self.disks,
                "resident_bytes": self.resident_bytes, "budget_bytes": self.budget_bytes,
                "experts_per_tier": experts_per_tier, "counts": self.counts, "tier": self.tier,
                "recent": self.recent, "held_experts": held, "placed_experts": self.store.placed_experts}

    @classmethod
    def from_pb(cls, store: StoreRef, r: expert_store_pb2.HeatResponse) -> StoreHeat:
        layers, n = [int(x) for x in r.moe_layers], int(r.n_experts)
        arrays = {}
        for name, dtype in (("counts", "uint32"), ("tier", "uint8"), ("recent", "uint8")):
            a = from_pb(getattr(r, name), f"Heat.{name}", dtype=dtype, ndim=2)
            if a.shape != (len(layers), n):
                raise MoetierError(f"Heat.{name}: shape {list(a.shape)} where [{len(layers)}, {n}] is expected")
            arrays[name] = a.reshape(-1).astype(np.int64).tolist()
        return cls(store, None, layers, n, arrays["counts"], arrays["tier"], arrays["recent"], list(r.disks),
                   int(r.resident_bytes), int(r.budget_bytes), int(r.step))


class ClusterSource:
    """The gateway's own channels to the router and the stores (not the request path's)."""

    def __init__(self, router_address: str, timeout_s: float = 1.0) -> None:
        self.router_address = router_address
        self.timeout_s = timeout_s
        self._router = grpc.aio.insecure_channel(router_address)
        self._stores: dict[str, grpc.aio.Channel] = {}
        self._http = httpx.AsyncClient(timeout=timeout_s)

    async def close(self) -> None:
        await self._router.close()
        for ch in self._stores.values():
            await ch.close()
        self._stores.clear()
        await self._http.aclose()

    async def stores(self) -> list[StoreRef]:
        """The expert stores registered with the router. Raises MoetierError when it is unreachable."""
        try:
            r = await router_pb2_grpc.RouterStub(self._router).ClusterStatus(
                router_pb2.ClusterStatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise MoetierError(f"router at {self.router_address} unreachable: {e.details() or e.code().name}") from None
        refs = [StoreRef(m.member_id, m.address, m.metrics_address, m.placed_experts) for m in r.members
                if m.kind == router_pb2.MEMBER_KIND_EXPERT_STORE]
        await self._forget({s.address for s in refs})
        return sorted(refs, key=lambda s: s.member_id)

    async def heat(self, store: StoreRef) -> StoreHeat:
        if not store.address:
            return StoreHeat(store, f"{store.member_id} registered without an address")
        ch = self._stores.get(store.address)
        if ch is None:
            ch = self._stores[store.address] = grpc.aio.insecure_channel(store.address)
        try:
            r = await expert_store_pb2_grpc.ExpertStoreStub(ch).Heat(expert_store_pb2.HeatRequest(),
                                                                     timeout=self.timeout_s)
            return StoreHeat.from_pb(store, r)
        except grpc.aio.AioRpcError as e:
            return StoreHeat(store, f"{store.member_id} at {store.address}: {e.details() or e.code().name}")
        except MoetierError as e:
            return StoreHeat(store, f"{store.member_id} at {store.address}: {e}")

    async def heats(self, stores: list[StoreRef]) -> list[StoreHeat]:
        return list(await asyncio.gather(*(self.heat(s) for s in stores)))

    async def hits_misses(self, stores: list[StoreRef]) -> tuple[float, float] | None:
        """Demand hits and misses summed over the stores' /metrics; None when none answered."""
        results = await asyncio.gather(*(self._scrape(s) for s in stores if s.metrics_address))
        answered = [r for r in results if r is not None]
        if not answered:
            return None
        return sum(h for h, _ in answered), sum(m for _, m in answered)

    async def _scrape(self, store: StoreRef) -> tuple[float, float] | None:
        try:
            r = await self._http.get(f"http://{store.metrics_address}/metrics")
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.debug("metrics of %s at %s: %s", store.member_id, store.metrics_address, e)
            return None
        sums = {HITS_METRIC: 0.0, MISSES_METRIC: 0.0}
        for family in text_string_to_metric_families(r.text):
            if family.name in sums:
                sums[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return sums[HITS_METRIC], sums[MISSES_METRIC]

    async def _forget(self, live: set[str]) -> None:
        """Close the channels of stores that left the cluster."""
        for address in [a for a in self._stores if a not in live]:
            await self._stores.pop(address).close()
