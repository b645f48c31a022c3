"""ShardedExperts: the forward pass's expert provider over several expert stores, each owning
part of the experts, placed by the router's placement map (moetier/placement.py).

Per MoE layer per step, the layer's batch union is split by owner (`PlacementMap.assign`) and
one ComputeExperts goes to each store that got part of it, all under way at once (each store's
`RemoteExperts`: its own channel, caller thread and local lane where the store is on this
host). A union that one store owns entirely is one ordinary call, answered with combined rows,
exactly as with a single store. A union spread over several stores asks each for its slots'
own outputs (`slot_outputs`: ids of the other stores' slots sent as -1); they are placed in one
[T, K, D] buffer and summed by `combine_slots`, the k-ordered sum a single store ends in. Each
slot's output depends on its row and expert alone, and every row routed to an expert goes to
the one store computing that expert, so the output is bit for bit one store's.

A store that fails a call (down, restarting, deadline, or no longer holding an expert) is put
aside for `down_s` and the layer is computed again without it, from the experts' other owners,
until the call's deadline (`timeout_s` from the layer's start). Experts owned only by stores put
aside by earlier calls are tried on them once more (a store may have restarted since), so only
the stores that failed this layer's call stay out of it; a store that answers is no longer put
aside. Experts with no live owner fail the step at once with Unavailable naming the layer and
the experts. The map is polled from the router (`Router.Placement`) every `refresh_s` by a
thread of its own, and fetched again when a layer finds an expert without a live owner, so a
store that joins or comes back takes its share within a poll. The error names the rows that
need the missing experts (`RowsUnavailable`): the batcher fails only their requests and steps
the others again.

Legend: T = rows, D = hidden, K = experts per row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import fields

import grpc
import numpy as np
import numpy.typing as npt

from moetier.errors import MoetierError, NotFound, RowsUnavailable, Unavailable
from moetier.model.ops import DoneCall, combine_slots
from moetier.placement import ExpertRange, PlacementMap, StoreEntry
from moetier.rpc.channels import RECONNECT_OPTIONS
from moetier.rpc.errors import from_rpc_error
from moetier.rpc.v1 import router_pb2, router_pb2_grpc
from services.dense_worker.remote import (
    RemoteExperts,
    RemoteStats,
    SharedCompute,
    _Call,
    _LaneCall,
)
from services.dense_worker.timing import PhaseClock

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


class PlacementClient:
    """The router's placement map, kept current by a poller thread (and `refresh()`)."""

    def __init__(self, router_address: str, *, timeout_s: float = 2.0, refresh_s: float = 1.0) -> None:
        self.router_address = router_address
        self.timeout_s, self.refresh_s = timeout_s, refresh_s
        self.map = PlacementMap([], 0)
        self._channel = grpc.insecure_channel(router_address, options=RECONNECT_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, daemon=True, name="dense-worker-placement")
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Unavailable as e:
                log.debug("placement map not refreshed: %s", e)

    def refresh(self) -> PlacementMap:
        """Ask the router now (Unavailable when it does not answer); the current map."""
        req = router_pb2.PlacementRequest(known_version=self.map.version) if self.map.version else \
            router_pb2.PlacementRequest()
        try:
            resp = self._stub.Placement(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"router {self.router_address}: Placement") from None
        with self._lock:
            if resp.changed and resp.version != self.map.version:
                self.map = PlacementMap([StoreEntry(s.member_id, s.address, s.weight,
                                                    tuple(ExpertRange(r.layer, r.first, r.last) for r in s.owned))
                                         for s in resp.stores], resp.version)
                log.info("placement map v%d: %s", resp.version,
                         ", ".join(f"{s.member_id} at {s.address}" for s in self.map.stores) or "no expert store")
            return self.map

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.refresh_s)
        self._channel.close()


class _ShardedCall:
    """One layer under way on one or more stores; `result()` combines, or retries without a
    store that failed."""

    def __init__(self, owner: ShardedExperts, layer: int, x: F32, ids: I32, weights: F32, deadline: float,
                 parts: list[tuple[str, npt.NDArray[np.bool_] | None, _Call | _LaneCall | DoneCall]],
                 failed_here: frozenset[str] = frozenset()) -> None:
        self.owner, self.layer, self.x, self.ids, self.weights = owner, layer, x, ids, weights
        self.deadline, self.parts, self.failed_here = deadline, parts, failed_here

    def result(self) -> F32:
        failed: str | None = None
        try:
            if len(self.parts) == 1 and self.parts[0][1] is None:
                failed = self.parts[0][0]
                out = self.parts[0][2].result()  # one store: its combined rows, as a single store's
                self.owner._answered(failed)
                return out
            t, k = self.ids.shape
            slots = np.zeros((t, k, self.x.shape[1]), dtype=np.float32)  # [T, K, D]
            for n, (store, mask, call) in enumerate(self.parts):
                failed = store
                out = call.result()  # [N_store, D], the store's slots in row-major (t, k) order
                assert mask is not None
                slots[mask] = out
                self.owner._answered(store)
                if n == len(self.parts) - 1:
                    failed = None
            return combine_slots(slots, self.weights)  # the k-ordered sum one store ends in
        except (Unavailable, NotFound) as e:
            for store, _, call in self.parts:
                if store != failed:
                    call.abandon()
            assert failed is not None
            return self.owner._retry(self, failed, e)

    def abandon(self) -> None:
        for _, _, call in self.parts:
            call.abandon()


class ShardedExperts:
    """ExpertProvider (moetier.model.ops) over the expert stores of the router's placement map."""

    def __init__(self, router_address: str, model_id: str, *, timeout_s: float, prefetch_timeout_s: float = 0.5,
                 clock: PhaseClock | None = None, hidden_size: int | None = None, local_lane: bool = True,
                 refresh_s: float = 1.0, down_s: float = 2.0, shared: SharedCompute | None = None) -> None:
        self.model_id, self.timeout_s, self.prefetch_timeout_s = model_id, timeout_s, prefetch_timeout_s
        self.clock, self.hidden_size, self.local_lane, self.shared = clock, hidden_size, local_lane, shared
        self.down_s = down_s
        self.placement = PlacementClient(router_address, refresh_s=refresh_s)
        self.step = 0
        self._stores: dict[str, RemoteExperts] = {}  # member_id -> its client (for the map's address)
        self._retired = RemoteStats()  # counters of clients closed since (their store left or moved)
        # member_id -> (monotonic time it may be tried again, the address that failed)
        self._down: dict[str, tuple[float, str]] = {}
        self._version = -1  # map version the clients were last reconciled with
        self._retired_calls: deque[float] = deque()  # round trips of closed clients, not yet read

    # ---- the provider --------------------------------------------------------------
    def new_step(self) -> int:
        self.step += 1
        for c in self._stores.values():
            c.step = self.step
        return self.step

    def moe(self, layer: int, x: F32, ids: I32, weights: F32) -> F32:
        return self.moe_start(layer, x, ids, weights).result()

    def moe_start(self, layer: int, x: F32, ids: I32, weights: F32) -> _ShardedCall:
        return self._start(layer, x, ids, weights, time.monotonic() + self.timeout_s)

    def _start(self, layer: int, x: F32, ids: I32, weights: F32, deadline: float,
               failed_here: frozenset[str] = frozenset()) -> _ShardedCall:
        """The layer sent to its experts' owners; `failed_here`: the stores that failed this
        layer's call already (left out of it, where stores put aside earlier are tried again)."""
        pmap = self._current()
        union = np.unique(ids)
        assign, missing = pmap.assign(layer, union.tolist(), self._down_now())
        if missing:  # a store may have joined since the last poll
            pmap = self._current(refresh=True)
            assign, missing = pmap.assign(layer, union.tolist(), self._down_now())
        if missing and self._down_now() - failed_here:
            # only stores put aside own these: try those put aside by earlier calls once more before
            # failing the rows (a store put aside after one failed call may serve again, e.g.
            # restarted since); those that failed this layer's call stay out
            again, still = pmap.assign(layer, union.tolist(), failed_here)
            if len(still) < len(missing):
                log.info("layer %d: experts %s are owned only by stores put aside (%s); trying them again",
                         layer, missing[:8], ", ".join(sorted(self._down_now() - failed_here)))
                assign, missing = again, still
        if missing:  # the rows needing these fail; the caller may step the others again
            rows = np.flatnonzero(np.isin(ids, np.asarray(missing, dtype=ids.dtype)).any(axis=1))
            raise RowsUnavailable(self._no_owner(pmap, layer, missing), frozenset(rows.tolist()))
        remaining = max(deadline - time.monotonic(), 1e-3)
        parts: list[tuple[str, npt.NDArray[np.bool_] | None, _Call | _LaneCall | DoneCall]] = []
        try:
            if len(assign) == 1:
                (i, _), = assign.items()
                store = pmap.stores[i]
                parts.append((store.member_id, None,
                              self._client(store).moe_start(layer, x, ids, weights, timeout_s=remaining)))
            else:
                for i, experts in sorted(assign.items()):
                    store = pmap.stores[i]
                    mask = np.isin(ids, np.asarray(experts, dtype=ids.dtype))  # [T, K] this store's slots
                    part_ids = np.where(mask, ids, -1).astype(np.int32)
                    parts.append((store.member_id, mask, self._client(store).moe_start(
                        layer, x, part_ids, weights, slot_outputs=True, timeout_s=remaining)))
        except (Unavailable, NotFound) as e:  # sending failed (a local lane that broke)
            for _, _, call in parts:
                call.abandon()
            failed = pmap.stores[sorted(assign)[len(parts)]].member_id
            return _Retry(self._retry_start(layer, x, ids, weights, deadline, failed, e, failed_here))
        return _ShardedCall(self, layer, x, ids, weights, deadline, parts, failed_here)

    def _retry(self, call: _ShardedCall, failed: str, error: MoetierError) -> F32:
        return self._retry_start(call.layer, call.x, call.ids, call.weights, call.deadline, failed, error,
                                 call.failed_here).result()

    def _retry_start(self, layer: int, x: F32, ids: I32, weights: F32, deadline: float, failed: str,
                     error: MoetierError, failed_here: frozenset[str] = frozenset()) -> _ShardedCall:
        """The layer again without `failed`, while its deadline lasts."""
        client = self._stores.get(failed)
        self._down[failed] = (time.monotonic() + self.down_s, client.address if client is not None else "")
        if time.monotonic() >= deadline:
            raise Unavailable(f"layer {layer}: expert store {failed} failed ({error}) and the call's deadline "
                              f"({self.timeout_s:g} s) is over") from None
        log.warning("layer %d: expert store %s failed (%s); computing its share on the other owners", layer,
                    failed, error)
        return self._start(layer, x, ids, weights, deadline, failed_here | {failed})

    def _no_owner(self, pmap: PlacementMap, layer: int, missing: list[int]) -> str:
        down = sorted(self._down_now())
        shown = ", ".join(str(e) for e in missing[:32]) + (" ..." if len(missing) > 32 else "")
        return (f"layer {layer}: no live expert store holds experts [{shown}] ({len(missing)} of the batch's; "
                f"stores in the placement map: {', '.join(s.member_id for s in pmap.stores) or 'none'}"
                f"{'; failing: ' + ', '.join(down) if down else ''})")

    def wants_hints(self) -> bool:
        """False while every store of the map said hints cannot help it (settled)."""
        stores = [self._stores.get(s.member_id) for s in self.placement.map.stores]
        return not stores or any(c is None or c.wants_hints() for c in stores)

    def prefetch(self, layer: int, ids: I32) -> None:
        pmap = self.placement.map
        assign, _ = pmap.assign(layer, np.asarray(ids).tolist(), self._down_now())
        for i, experts in assign.items():
            client = self._stores.get(pmap.stores[i].member_id)
            if client is not None and client.address == pmap.stores[i].address:
                client.prefetch(layer, np.asarray(experts, dtype=np.int32))

    # ---- stores --------------------------------------------------------------------
    def _answered(self, store: str) -> None:
        """`store` answered a call: it is live, and no longer put aside."""
        if store in self._down:
            del self._down[store]
            log.info("expert store %s answered again; no longer put aside", store)

    def _down_now(self) -> frozenset[str]:
        now = time.monotonic()
        for store in [s for s, (until, _) in self._down.items() if until <= now]:
            del self._down[store]
        return frozenset(self._down)

    def _current(self, refresh: bool = False) -> PlacementMap:
        """The map (fetched now when asked, or when none was ever fetched), clients reconciled."""
        pmap = self.placement.map
        if refresh or pmap.version == 0:
            try:
                pmap = self.placement.refresh()
            except Unavailable as e:
                if pmap.version == 0:
                    raise Unavailable(f"no placement map: {e}") from None
                log.warning("placement map not refreshed (%s); using v%d", e, pmap.version)
        if pmap.version != self._version:
            self._reconcile(pmap)
        return pmap

    def _reconcile(self, pmap: PlacementMap) -> None:
        """Close the clients of stores that left the map or moved (on the step thread, between calls)."""
        where = {s.member_id: s.address for s in pmap.stores}
        for store, client in list(self._stores.items()):
            if where.get(store) != client.address:
                del self._stores[store]
                self._retire(client)
        for store in [s for s, (_, address) in self._down.items() if where.get(s) != address]:
            del self._down[store]  # gone from the map, or back at another address: try it at once
        self._version = pmap.version

    def _retire(self, client: RemoteExperts) -> None:
        for f in fields(RemoteStats):
            setattr(self._retired, f.name, getattr(self._retired, f.name) + getattr(client.stats, f.name))
        self._retired_calls.extend(client.call_seconds)
        client.close()

    def _client(self, store: StoreEntry) -> RemoteExperts:
        client = self._stores.get(store.member_id)
        if client is None or client.address != store.address:
            client = RemoteExperts(store.address, self.model_id, timeout_s=self.timeout_s,
                                   prefetch_timeout_s=self.prefetch_timeout_s, clock=self.clock,
                                   hidden_size=self.hidden_size, local_lane=self.local_lane, shared=self.shared)
            client.step = self.step
            self._stores[store.member_id] = client
        return client

    # ---- what the worker reads -----------------------------------------------------
    @property
    def stats(self) -> RemoteStats:
        """Counters over every store, those that left included."""
        out = RemoteStats(**{f.name: getattr(self._retired, f.name) for f in fields(RemoteStats)})
        for client in list(self._stores.values()):
            for f in fields(RemoteStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(client.stats, f.name))
        return out

    @property
    def call_seconds(self) -> deque[float]:
        """ComputeExperts round trips since the last read, every store's (drained by the reader)."""
        out = self._retired_calls
        self._retired_calls = deque()
        for client in list(self._stores.values()):
            while client.call_seconds:
                out.append(client.call_seconds.popleft())
        return out

    def check(self) -> None:
        """Fetch the map and reach every store in it (Unavailable: no map, no store, or one down)."""
        self.placement.start()  # polls from now on, also while the router is not up yet
        pmap = self._current(refresh=True)
        if not len(pmap):
            raise Unavailable(f"the placement map of router {self.placement.router_address} has no expert store yet")
        for store in pmap.stores:
            self._client(store).check()

    def flush_usage(self, force: bool = False) -> None:
        """RemoteExperts.flush_usage of every store's client."""
        for client in list(self._stores.values()):
            client.flush_usage(force)

    def close(self) -> None:
        self.placement.close()
        for client in self._stores.values():
            client.close()
        self._stores.clear()


class _Retry(_ShardedCall):
    """A call whose send failed and was started again: its result is the new call's."""

    def __init__(self, inner: _ShardedCall) -> None:
        self.inner = inner

    def result(self) -> F32:
        return self.inner.result()

    def abandon(self) -> None:
        self.inner.abandon()
