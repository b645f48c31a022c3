"""RemoteExperts: the forward pass's expert provider over the expert store's gRPC API.

One `ComputeExperts` call per MoE layer per step, carrying every row of the step (the
batch union), with a deadline of `timeout_s`; prefetch hints go out as `Prefetch` calls
that nobody waits for. Both carry the step counter (`new_step()`), so the store can
drop hints that went stale.

Hints are handed to one sender thread (a bounded queue; a hint that finds it full is
dropped and counted failed), which makes the blocking `Prefetch` calls. Not grpc's
`future()` from the step thread: on a channel with no call in flight that starts a new
polling thread per call, and the step waits for the thread to start (measured on 2 busy
cores: ~0.9 ms median, 2 ms p90 per hint, 26 hints per mini-glm token; a queue hand-off
is ~0.02 ms).

A MoE layer with a shared expert starts its call with `moe_start`: a thread of this provider
(the caller) makes the blocking call while the step thread computes the shared expert, so the
round trip's latency (the wire, both sides' gRPC, the store's thread hand-offs) overlaps work
the step has to do anyway; the step then waits for the rest. Measured on 2 busy cores, a
queue hand-off costs ~0.02 ms against a round trip of ~1.5 ms beyond the store's own compute.

Where the store is on this host (its Info names a local lane it answers on), calls and hints go
over that lane instead (moetier/rpc/local.py: one unix socket packet each way, the tensors in
shared memory; about a tenth of a gRPC round trip): `moe_start` then sends the call at once and
`result()` waits for its answer, with no thread in between. A call whose tensors do not fit the
lane's region goes over gRPC; a lane that fails is dropped (the call fails with Unavailable, as
over gRPC) and the next call connects afresh, lane included.

Where that store shares its experts over the lane (its RAM tier holds them all: storage.share), the
calls are computed here instead, from its shared memory with this worker's kernels, the way the
store computes them (the same bits); what was computed is reported to the store (LocalUsage) every
USAGE_EVERY_S and when the worker goes idle. A lane found closed before such a call sends it the
usual way, which fails while the store is down.

Called from the worker's one step thread, so the channel is a plain (synchronous) gRPC
channel. A store that is down, slow or restarting fails the call with Unavailable once
the deadline (or the connection attempt) is over; the channel is then rebuilt, so the
next call connects afresh instead of waiting out gRPC's reconnect backoff. Before its
first call on a new channel the provider asks the store's `Info` and refuses a store
serving another model (its expert ids would mean other experts).

Legend: T = rows, D = hidden, K = experts per row.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument, MoetierError, Unavailable
from moetier.model.ops import DoneCall, Ops, combine_slots
from moetier.rpc.channels import RECONNECT_OPTIONS
from moetier.rpc.errors import from_rpc_error
from moetier.rpc.local import LocalClient
from moetier.rpc.tensors import from_pb, to_pb
from moetier.rpc.v1 import expert_store_pb2, expert_store_pb2_grpc
from moetier.weights.quant import ExpertWeights
from services.dense_worker.timing import PhaseClock

if TYPE_CHECKING:
    from moetier.kernels.fast import ExpertTable

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

HINT_QUEUE = 64  # hints waiting for the sender at most; later ones are dropped (a waiting hint goes stale)
USAGE_EVERY_S = 0.25  # how often calls computed from the store's shared experts are reported to it
USAGE_ROWS = 3000  # (layer, expert) rows per LocalUsage frame (16 bytes each: well inside a lane frame)
MAX_MESSAGE_BYTES = 1 << 30  # a prefill chunk of a wide model is tens of MB of activations
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    *RECONNECT_OPTIONS,  # a restarted store is found within a second
]


@dataclass
class SharedCompute:
    """What computing a store's shared experts here takes: this worker's kernels and the
    container's record parser (verified record bytes -> ExpertWeights)."""

    ops: Ops
    parse: Callable[[npt.NDArray[np.uint8]], ExpertWeights]


@dataclass
class RemoteStats:
    """Counters since start; the metrics module turns deltas into Prometheus counters."""

    calls: int = 0
    failed_calls: int = 0
    rows: int = 0
    store_hits: int = 0  # experts of a call's union the store had in RAM
    store_misses: int = 0
    hints_sent: int = 0  # Prefetch calls
    hints_failed: int = 0  # Prefetch calls that failed (never fails a request)
    call_s: float = 0.0  # ComputeExperts round trips, summed (whoever waited for them)
    shared_calls: int = 0  # calls computed here from the store's shared experts (not sent)


class _Call:
    """A ComputeExperts call under way on the caller thread (`RemoteExperts.moe_start`)."""

    def __init__(self, owner: RemoteExperts, layer: int, x: F32,
                 future: Future[expert_store_pb2.ComputeExpertsResponse], rows: int) -> None:
        self.owner, self.layer, self.x, self.future, self.rows = owner, layer, x, future, rows

    def result(self) -> F32:
        t0 = time.perf_counter()
        try:
            resp = self.future.result()  # the call's own deadline bounds the wait
        finally:
            if self.owner.clock is not None:
                self.owner.clock.add("expert", time.perf_counter() - t0)
        return self.owner._output(self.layer, self.x, resp, rows=self.rows)

    def abandon(self) -> None:
        self.future.cancel()  # a call already made runs to its end (or deadline) and is dropped


class _LaneCall:
    """A ComputeExperts call sent on the local lane; `result()` waits for the answer. Holds the
    lane's lock from the send until the answer (one call at a time per lane)."""

    def __init__(self, owner: RemoteExperts, lane: LocalClient, layer: int, x: F32,
                 req: expert_store_pb2.ComputeExpertsRequest, sent: float, rows: int, timeout_s: float) -> None:
        self.owner, self.lane, self.layer, self.x, self.req, self.sent = owner, lane, layer, x, req, sent
        self.rows, self.timeout_s = rows, timeout_s
        self._open = True

    def result(self) -> F32:
        owner = self.owner
        t0 = time.perf_counter()
        try:
            resp, out = self.lane.receive(self.req, self.timeout_s)
        except MoetierError:
            owner.stats.failed_calls += 1
            if self.lane.closed:
                owner._lane_failed(self.lane)
            raise
        finally:
            self._release()
            now = time.perf_counter()
            if owner.clock is not None:
                owner.clock.add("expert", now - t0)
            owner.stats.call_s += now - self.sent
            owner.call_seconds.append(now - self.sent)
        return owner._output(self.layer, self.x, resp, out, rows=self.rows)

    def abandon(self) -> None:
        """Nobody will read the answer: the lane is dropped (answers come in order)."""
        self.lane.close()
        self.owner._lane_failed(self.lane)
        self._release()

    def _release(self) -> None:
        if self._open:
            self._open = False
            self.lane.lock.release()


class _Usage:
    """Calls computed from the shared experts since the last LocalUsage: each call noted as it
    is made (a decode step makes one a layer), counted up when the report is made (or when
    FOLD_CALLS are waiting)."""

    FOLD_CALLS = 4096

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], list[int], int]] = []  # (layer, union, slots of each, rows)
        self.experts: dict[tuple[int, int], list[int]] = {}  # (layer, expert) -> [calls, slots], counted
        self.layer_calls: dict[int, list[int]] = {}  # layer -> [calls, rows], counted
        self.since = time.monotonic()

    @property
    def empty(self) -> bool:
        """No call was noted."""
        return not (self.calls or self.layer_calls)

    def add(self, layer: int, union: list[int], slots: list[int], rows: int) -> None:
        """A call of `layer`: its batch union, the slots routed to each, its rows."""
        self.calls.append((layer, union, slots, rows))
        if len(self.calls) >= self.FOLD_CALLS:
            self._fold()

    def _fold(self) -> None:
        for layer, union, slots, rows in self.calls:
            for e, n in zip(union, slots, strict=True):
                c = self.experts.setdefault((layer, e), [0, 0])
                c[0] += 1
                c[1] += n
            lc = self.layer_calls.setdefault(layer, [0, 0])
            lc[0] += 1
            lc[1] += rows
        self.calls = []

    def messages(self) -> list[expert_store_pb2.LocalUsage]:
        """The counts as LocalUsage frames small enough for the lane (USAGE_ROWS experts each)."""
        self._fold()
        ex = np.array([(k[0], k[1], c[0], c[1]) for k, c in self.experts.items()], dtype=np.int32).reshape(-1, 4)
        ly = np.array([(k, c[0], c[1]) for k, c in self.layer_calls.items()], dtype=np.int64).reshape(-1, 3)
        out = []
        for i in range(0, max(len(ex), 1), USAGE_ROWS):
            out.append(expert_store_pb2.LocalUsage(experts=to_pb(ex[i : i + USAGE_ROWS]),
                                                   layers=to_pb(ly if i == 0 else ly[:0])))
        return out


def _rows(ids: I32, x: F32, slot_outputs: bool) -> int:
    """Rows of a call's answer: x's, or with slot_outputs the slots it computes."""
    return int((ids >= 0).sum()) if slot_outputs else len(x)


class RemoteExperts:
    """ExpertProvider (moetier.model.ops) over one expert store."""

    def __init__(self, address: str, model_id: str, *, timeout_s: float, prefetch_timeout_s: float = 0.5,
                 clock: PhaseClock | None = None, hidden_size: int | None = None, local_lane: bool = True,
                 shared: SharedCompute | None = None) -> None:
        """local_lane: use the store's local lane when it is on this host (else gRPC only).
        shared: compute the calls here where the store shares its experts over the lane."""
        self.address = address
        self.local_lane = local_lane
        self.shared = shared
        self._lane: LocalClient | None = None  # the store's local lane, when connected
        self._weights: dict[tuple[int, int], ExpertWeights] = {}  # parsed shared records of this lane
        self._tables: dict[tuple[int, int], ExpertTable | None] = {}  # (layer, experts) -> resident_table's
        self._usage = _Usage()
        self.model_id = model_id
        self.timeout_s = timeout_s
        self.prefetch_timeout_s = prefetch_timeout_s
        self.clock = clock
        self.hidden_size = hidden_size
        self.step = 0
        self.settled = False  # the store's last answer said hints cannot help it now
        self.stats = RemoteStats()
        self.call_seconds: deque[float] = deque()  # drained by the metrics after each step
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: expert_store_pb2_grpc.ExpertStoreStub | None = None
        self._checked = False  # Info verified on the current channel
        self._caller: ThreadPoolExecutor | None = None  # makes the calls of `moe_start`, once one is made
        self._hints: queue.Queue[tuple[expert_store_pb2_grpc.ExpertStoreStub, expert_store_pb2.PrefetchRequest]
                                 | None] | None = None  # the sender's queue, while a sender runs

    # ---- the provider --------------------------------------------------------------
    def wants_hints(self) -> bool:
        """False while the store's last answer said hints cannot help it now
        (ComputeExpertsResponse.settled)."""
        return not self.settled

    def new_step(self) -> int:
        self.step += 1
        return self.step

    def moe(self, layer: int, x: F32, ids: I32, weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D], computed by the store in one call (or here, from
        its shared experts)."""
        y = self._shared_compute(layer, x, ids, weights)
        if y is not None:
            return y
        call = self._lane_start(layer, x, ids, weights)
        if call is not None:
            return call.result()
        req = self._request(layer, x, ids, weights)
        t0 = time.perf_counter()
        try:
            resp = self._call(layer, req)
        finally:
            if self.clock is not None:
                self.clock.add("expert", time.perf_counter() - t0)
        return self._output(layer, x, resp)

    def moe_start(self, layer: int, x: F32, ids: I32, weights: F32, *, slot_outputs: bool = False,
                  timeout_s: float | None = None) -> _Call | _LaneCall | DoneCall:
        """`moe` under way: the call is made by the caller thread while the step thread goes on
        (the shared expert); `result()` waits for it. The step clock's "expert" phase counts the
        wait only. On the local lane the call is sent here and nothing else is needed.
        slot_outputs: ids of -1 are another store's slots, and `result()` is [N, D], the output
        of each slot this store computed (see ComputeExpertsRequest.slot_outputs). timeout_s:
        this call's deadline (default `self.timeout_s`)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        y = self._shared_compute(layer, x, ids, weights, slot_outputs)
        if y is not None:
            return DoneCall(y)
        lane_call = self._lane_start(layer, x, ids, weights, slot_outputs, timeout)
        if lane_call is not None:
            return lane_call
        req = self._request(layer, x, ids, weights)
        if slot_outputs:
            req.slot_outputs = True
        with self._lock:
            if self._caller is None:
                self._caller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-worker-experts")
            caller = self._caller
        return _Call(self, layer, x, caller.submit(self._call, layer, req, timeout), _rows(ids, x, slot_outputs))

    def _lane_start(self, layer: int, x: F32, ids: I32, weights: F32, slot_outputs: bool = False,
                    timeout_s: float | None = None) -> _LaneCall | None:
        """The call sent on the local lane; None where there is none (or its region is too small
        for these tensors): the caller uses gRPC."""
        lane = self._connected_lane()
        if lane is None:
            return None
        req = expert_store_pb2.ComputeExpertsRequest(layer=layer, step=self.step)
        if slot_outputs:
            req.slot_outputs = True
        lane.lock.acquire()
        try:
            sent = time.perf_counter()
            lane.send_compute(req, np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int32),
                              np.ascontiguousarray(weights, dtype=np.float32))
        except ValueError:  # a prefill chunk larger than the region
            lane.lock.release()
            return None
        except MoetierError:
            lane.lock.release()
            self.stats.failed_calls += 1
            self._lane_failed(lane)
            raise
        return _LaneCall(self, lane, layer, x, req, sent, _rows(ids, x, slot_outputs),
                         self.timeout_s if timeout_s is None else timeout_s)

    def _connected_lane(self) -> LocalClient | None:
        """The store's local lane, connecting first if this provider has not asked the store yet;
        None where there is none (the caller uses gRPC)."""
        if not self._checked and self.local_lane:
            try:
                self._ready()  # Info, and the lane where the store has one on this host
            except (grpc.RpcError, MoetierError):
                return None  # the gRPC path makes the call and says what is wrong
        return self._lane

    def _sharing_lane(self) -> LocalClient | None:
        """The lane of a store that shares its experts with this worker, checked alive as every
        call checks it; None otherwise (or where the store is gone): the call goes to the store."""
        lane = self._connected_lane() if self.shared is not None else None
        if lane is None or lane.shared is None:
            return None
        if not lane.alive():  # the store ended: its calls fail (or reconnect) the usual way
            self._lane_failed(lane)
            return None
        return lane

    def _shared_weights(self, lane: LocalClient, layer: int, e: int) -> ExpertWeights | None:
        """Expert e of `layer` parsed from the lane's shared records (once), None where it is not
        shared."""
        w = self._weights.get((layer, e))
        if w is None:
            view, shared = lane.shared, self.shared
            if view is None or shared is None or (layer, e) not in view.where:
                return None
            w = self._weights[(layer, e)] = shared.parse(view.record(layer, e))
        return w

    @staticmethod
    def _union_counts(routed: I32) -> tuple[list[int], list[int]]:
        """The experts a call's slots are routed to, ascending, and the slots of each."""
        if routed.size <= 16:  # a decode step's few slots: plain Python is quicker than np.unique
            flat = routed.reshape(-1).tolist()
            union = sorted(set(flat))
            return union, [flat.count(e) for e in union]
        union_a, counts_a = np.unique(routed, return_counts=True)
        return union_a.tolist(), counts_a.tolist()

    def _count_shared(self, layer: int, union: list[int], counts: list[int], rows: int, seconds: float) -> None:
        """A call of `layer` computed here from the shared experts (`_union_counts` of its slots):
        counted for the store (its usage report), in the stats and in the "expert" phase."""
        if self.clock is not None:
            self.clock.add("expert", seconds)
        self.settled = True  # every expert resident, never evicted: hints cannot help
        self.stats.shared_calls += 1
        self.stats.rows += rows
        self.stats.store_hits += len(union)
        self._usage.add(layer, union, counts, rows)

    def _shared_compute(self, layer: int, x: F32, ids: I32, weights: F32, slot_outputs: bool = False) -> F32 | None:
        """The call computed here from the store's shared experts, as the store computes it
        (moetier.store.compute: one `expert_outputs` into a [T, K, D] buffer, then the k-ordered
        combine, or the slots themselves), so the same bits; None where the lane shares none of
        them (or not all), or is gone: the call goes to the store."""
        shared = self.shared
        lane = self._sharing_lane()
        if lane is None or shared is None:
            return None
        t0 = time.perf_counter()
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        union, counts = self._union_counts(ids[ids >= 0] if slot_outputs else ids)
        experts = {}
        for e in union:
            w = self._shared_weights(lane, layer, e)
            if w is None:
                return None
            experts[e] = w
        x = np.ascontiguousarray(x, dtype=np.float32)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        one_call = None if slot_outputs else getattr(shared.ops, "moe_plain", None)  # experts and combine at once
        y = None if one_call is None else one_call(x, ids, weights, experts)
        if y is None:
            slots = np.zeros((*ids.shape, x.shape[1]), dtype=np.float32)  # [T, K, D]
            shared.ops.expert_outputs(x, ids, experts, slots)
            y = slots[ids >= 0] if slot_outputs else combine_slots(slots, weights)
        self._count_shared(layer, union, counts, len(x), time.perf_counter() - t0)
        return y

    def resident_table(self, layer: int, ops: Ops, n_experts: int) -> ExpertTable | None:
        """Every expert of `layer` as one kernel-side table (FastOps.expert_table) where the store
        shares all n_experts of it over the lane and `ops` are this worker's kernels: MoeBlock.block
        then computes the layer here in one call, as `_shared_compute` would (the same bits). None
        otherwise, or where the store is gone (checked every call, as every call does)."""
        if self.shared is None or ops is not self.shared.ops:
            return None
        lane = self._sharing_lane()
        if lane is None:
            return None
        key = (layer, n_experts)
        if key in self._tables:
            return self._tables[key]
        table = None
        make = getattr(ops, "expert_table", None)
        if make is not None:
            experts = [w for e in range(n_experts) if (w := self._shared_weights(lane, layer, e)) is not None]
            if experts and len(experts) == n_experts:
                table = make(experts, experts[0].gate.shape[1])
        self._tables[key] = table
        return table

    def resident_done(self, layer: int, ids: I32, rows: int, seconds: float) -> None:
        """A call of `layer` computed from `resident_table`'s table: counted as `_shared_compute`
        counts its calls (its norm and router included in the "expert" phase)."""
        self._count_shared(layer, *self._union_counts(ids), rows, seconds)

    def flush_usage(self, force: bool = False) -> None:
        """Report the calls computed from the shared experts to the store, at most every
        USAGE_EVERY_S seconds (force: now), so its heat, hits and calls count them."""
        u = self._usage
        if u.empty or (not force and time.monotonic() - u.since < USAGE_EVERY_S):
            return
        self._usage = _Usage()
        lane = self._lane
        if lane is None:
            return  # the lane is gone, and with it the store these were for
        try:
            for msg in u.messages():
                lane.usage(msg)
        except Unavailable:
            self._lane_failed(lane)

    def _lane_failed(self, lane: LocalClient) -> None:
        """The lane broke: drop it and the channel, so the next call checks the store again."""
        if self._lane is lane:
            log.warning("expert store %s: local lane %s failed; reconnecting on the next call", self.address,
                        lane.name)
            self.close()

    def _request(self, layer: int, x: F32, ids: I32, weights: F32) -> expert_store_pb2.ComputeExpertsRequest:
        return expert_store_pb2.ComputeExpertsRequest(
            layer=layer, hidden=to_pb(np.ascontiguousarray(x, dtype=np.float32)),
            expert_ids=to_pb(np.ascontiguousarray(ids, dtype=np.int32)),
            weights=to_pb(np.ascontiguousarray(weights, dtype=np.float32)), step=self.step)

    def _call(self, layer: int, req: expert_store_pb2.ComputeExpertsRequest,
              timeout_s: float | None = None) -> expert_store_pb2.ComputeExpertsResponse:
        """The blocking ComputeExperts round trip (on the step thread, or the caller thread)."""
        t0 = time.perf_counter()
        try:
            stub = self._ready()
            return stub.ComputeExperts(req, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as e:
            self._failed(e)
            raise from_rpc_error(e, f"expert store {self.address}: ComputeExperts of layer {layer}") from None
        except MoetierError:
            self.stats.failed_calls += 1
            raise
        finally:
            dt = time.perf_counter() - t0
            self.stats.call_s += dt
            self.call_seconds.append(dt)

    def _output(self, layer: int, x: F32, resp: expert_store_pb2.ComputeExpertsResponse,
                out: F32 | None = None, rows: int | None = None) -> F32:
        """The answer checked (`out`: its output, already read from the local lane's region;
        `rows`: the rows it must have, default x's)."""
        try:
            if out is None:
                out = from_pb(resp.output, "ComputeExperts output", "float32", 2)
        except InvalidArgument as e:
            self.stats.failed_calls += 1
            raise Unavailable(f"expert store {self.address}: malformed answer for layer {layer}: {e}") from None
        want = (len(x) if rows is None else rows, x.shape[1])
        if out.shape != want:
            self.stats.failed_calls += 1
            raise Unavailable(f"expert store {self.address}: ComputeExperts of layer {layer} returned "
                              f"{list(out.shape)}, expected {list(want)}")
        self.settled = resp.settled
        self.stats.calls += 1
        self.stats.rows += len(x)
        self.stats.store_hits += resp.hits
        self.stats.store_misses += resp.misses
        return out

    def prefetch(self, layer: int, ids: I32) -> None:
        """Fire and forget: the hint goes to the sender thread, the step does not wait for it."""
        stub = self._stub
        if stub is None or not self._checked:
            return  # not connected yet; hints are worth nothing to a store we have not reached
        req = expert_store_pb2.PrefetchRequest(layer=layer, expert_ids=[int(e) for e in ids], step=self.step)
        lane = self._lane
        if lane is not None:  # one packet, sent here: cheaper than the hand-off to the sender
            try:
                lane.prefetch(req)
            except Unavailable:
                self.stats.hints_failed += 1
                self._lane_failed(lane)
                return
            self.stats.hints_sent += 1
            return
        with self._lock:
            if self._hints is None:
                self._hints = queue.Queue(HINT_QUEUE)
                threading.Thread(target=self._send_hints, args=(self._hints,), daemon=True,
                                 name="dense-worker-hints").start()
            hints = self._hints
        try:
            hints.put_nowait((stub, req))
        except queue.Full:
            self.stats.hints_failed += 1
            return
        self.stats.hints_sent += 1

    def _send_hints(self, hints: queue.Queue[tuple[expert_store_pb2_grpc.ExpertStoreStub,
                                                   expert_store_pb2.PrefetchRequest] | None]) -> None:
        """The sender thread: one blocking Prefetch call per hint, until `close()` says stop."""
        while (item := hints.get()) is not None:
            stub, req = item
            try:
                stub.Prefetch(req, timeout=self.prefetch_timeout_s)
            except Exception:  # an RpcError, or the channel closed under it; never fails a request
                self.stats.hints_failed += 1

    # ---- the channel ---------------------------------------------------------------
    def _ready(self) -> expert_store_pb2_grpc.ExpertStoreStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
                self._stub = expert_store_pb2_grpc.ExpertStoreStub(self._channel)
                self._checked = False
            stub = self._stub
        if not self._checked:
            info = stub.Info(expert_store_pb2.InfoRequest(), timeout=self.timeout_s)
            if info.model_id != self.model_id:
                self.close()
                raise Unavailable(f"expert store {self.address} serves model {info.model_id}, this worker "
                                  f"serves {self.model_id}")
            if self.hidden_size is not None and info.hidden_size != self.hidden_size:
                self.close()
                raise Unavailable(f"expert store {self.address}: hidden size {info.hidden_size}, "
                                  f"this model's is {self.hidden_size}")
            self._checked = True
            if self.local_lane and info.local_socket:
                try:
                    lane = LocalClient.connect(info.local_socket, info.local_token, shared=self.shared is not None)
                except MoetierError as e:  # another host, another namespace: gRPC it is
                    log.info("expert store %s: local lane %s not reachable (%s); using gRPC", self.address,
                             info.local_socket, e)
                else:
                    if lane.shared is not None and lane.shared.model_id != self.model_id:
                        log.warning("expert store %s shares experts of model %s, not %s: not computing them here",
                                    self.address, lane.shared.model_id, self.model_id)
                        lane.shared = None
                    with self._lock:
                        self._lane = lane
                        self._weights = {}
            how = "gRPC"
            if self._lane is not None:
                how = f"local lane {info.local_socket}"
                if self._lane.shared is not None:
                    how += f", computing its {len(self._lane.shared.where)} shared experts here"
            log.info("expert store %s: %s, %s experts, model %s, %s", self.address, info.arch, info.expert_dtype,
                     info.model_id, how)
        return stub

    def _failed(self, e: grpc.RpcError) -> None:
        self.stats.failed_calls += 1
        code = e.code() if hasattr(e, "code") else None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
            self.close()  # reconnect on the next call, without gRPC's backoff

    def check(self) -> None:
        """Connect and verify the store now (raises Unavailable when it is down or another model's)."""
        try:
            self._ready()
        except grpc.RpcError as e:
            self._failed(e)
            raise from_rpc_error(e, f"expert store {self.address}: Info") from None

    def close(self) -> None:
        """Drop the channel and stop the hint sender (after its call in flight, if any); the next
        call connects afresh and the next hint starts a sender again."""
        with contextlib.suppress(MoetierError):
            self.flush_usage(force=True)
        with self._lock:
            channel, self._channel, self._stub, self._checked = self._channel, None, None, False
            hints, self._hints = self._hints, None
            lane, self._lane = self._lane, None
            self._weights = {}
            self._tables = {}
        if lane is not None:
            lane.close()
        if hints is not None:  # the hints still queued are for the old channel: drop them, then stop
            with contextlib.suppress(queue.Empty):
                while True:
                    hints.get_nowait()
            while True:
                try:
                    hints.put_nowait(None)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):
                        hints.get_nowait()
        if channel is not None:
            channel.close()
