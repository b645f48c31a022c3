"""The expert store's domain: one container's routed experts behind a RAM tier, computed
with the engine's kernels. No protobuf here (convert.py) and no gRPC (server.py).

Legend: T = rows, D = hidden, K = experts per row, E = experts per layer, L = MoE layers.

    core = StoreCore(settings)
    await core.start()                      # kernels warmed, history saver running
    result = await core.compute(batch)      # one MoE layer for a batch of rows
    core.prefetch(hint); core.heat(); core.info()
    await core.stop()                       # history saved, tier and container closed

Every ComputeExperts is one run of the tier-compute loop the in-process provider
(`TieredExperts`) runs too (`TierCompute`, moetier/store/compute.py): the batch union cut
into waves that fit the RAM tier's budget (one wave when the union fits), each wave pinned,
its experts computed as they become resident (the resident ones while the missing ones are
read) and released, then the k-ordered combine `FastOps.moe` ends in. So the store's output
is bit for bit the in-process engine's, and a union larger than the budget is slower (its
experts are read again), never refused.

Steps: callers send their step counter; a newer step ages queued prefetch reads
(`ExpertTier.new_step`) and a hint for an older step than the latest seen is stale and
dropped. With several callers the latest step is the largest any of them sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument, NotFound
from moetier.kernels.fast import FastOps, default_threads, warmup
from moetier.placement import ExpertRange, parse_owned, to_ranges
from moetier.rpc.local import SharedOffer
from moetier.settings import Settings
from moetier.store.compute import ComputeJob, ComputeResult, TierCompute
from moetier.store.stats import HEAT_PINNED, HEAT_RAM, DiskStats, TierStats
from moetier.store.tier import ExpertTier, tier_config
from moetier.testhooks import ReadDelay
from moetier.weights.container import Container
from moetier.weights.index import ExpertIndex, ExpertKey
from moetier.weights.quant import ExpertWeights, QDType, quantize
from services.expert_store.metrics import StoreMetrics

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]



@dataclass(frozen=True)
class ModelShape:
    """What requests are checked against (from the container)."""

    model_id: str  # identity of the expert index
    arch: str
    hidden_size: int  # D
    moe_layers: tuple[int, ...]
    n_experts: int  # E
    top_k: int  # the model's K (requests may use any K >= 1)
    record_bytes: int
    expert_dtype: str


@dataclass
class ComputeBatch:
    layer: int
    hidden: F32  # [T, D]
    ids: I32  # [T, K], each in [0, E); -1 (a slot another store computes) only with slot_outputs
    weights: F32  # [T, K]
    step: int | None = None
    slot_outputs: bool = False  # answer each computed slot's own output [N, D], uncombined


@dataclass
class SharedUsage:
    """Calls a dense worker computed from this store's shared experts (LocalUsage), by layer."""

    experts: list[tuple[int, I64, I64, I64]]  # (layer, expert ids, calls with each in the union, slots)
    layers: list[tuple[int, int, int]]  # (layer, calls, rows)


@dataclass
class PrefetchHint:
    layer: int
    ids: npt.NDArray[np.int64]  # [n] expert ids
    step: int | None = None


@dataclass
class PrefetchResult:
    queued: int
    resident: int  # already resident or being read
    dropped: int  # stale, prefetch disabled, over the bound or no room


@dataclass
class StoreInfo:
    shape: ModelShape
    budget_bytes: int
    policy: str
    disks: list[DiskStats]
    store_id: str
    owned: list[ExpertRange]  # the experts this store holds (its shard)
    read_bandwidth: float  # bytes/s of its copies together, as last probed (0: not yet)


@dataclass
class StoreHeat:
    layers: tuple[int, ...]
    counts: npt.NDArray[np.uint32]  # [L, E] (row, slot) pairs routed to each expert since start
    tier: npt.NDArray[np.uint8]  # [L, E] 0 = RAM, 1 + d = only on disk d (the copy a read would use),
    #                             NOT_HELD = not in this store's shard
    recent: npt.NDArray[np.uint8]  # [L, E] 1 = routed in the layer's latest ComputeExperts
    disks: list[str]
    resident_bytes: int
    budget_bytes: int
    step: int


# Calls of at most this many rows (decode steps) run their kernels on the event loop's thread
# when the compute thread has nothing queued: a few milliseconds of kernels (which release the
# GIL; their helper threads do the parallel part) in exchange for the two thread hand-offs of
# the compute thread. Measured through ComputeExperts of mini-glm, 6 resident experts, 1 row,
# 2 cores: the store's time outside load + kernels 0.55-0.73 ms on the compute thread,
# 0.28-0.41 ms inline. Larger calls (prefill chunks) keep the loop free for other requests.
INLINE_ROWS = 4
COMPUTE_THREADS = 4  # calls computed (or waiting for their reads) at once, beyond inline ones
NOT_HELD = 255  # heat tier of an expert outside this store's shard


def owned_index(container: Container, spec: str, store_id: str) -> ExpertIndex:
    """The records this store serves: the `storage.owned_experts` share of the container's,
    less those whose layer file is absent from its directory (a shard on its own disk)."""
    index = container.index
    want = parse_owned(spec, list(index.layers), index.n_experts)
    keys: list[ExpertKey] = [k for k in sorted(want) if index.records[k].path not in container.absent_experts]
    if not keys:
        absent = sorted(container.absent_experts)
        raise InvalidArgument(f"expert store {store_id}: holds none of the experts it is to own "
                              f"(storage.owned_experts {spec!r}; layer files absent from {container.path}/experts: "
                              f"{', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''})")
    if len(keys) == len(index):
        return index
    return ExpertIndex(index.root, {k: index.records[k] for k in keys}, index.identity, index.parse, index.layout)

def kernel_threads() -> int:
    """Kernel threads per call: every CPU this process may use (`default_threads()`), as the
    dense worker and the in-process engine. A decode step alternates between the worker (its
    attention, gates, shared experts) and the store (the routed experts): while the store
    computes, the worker waits for its answer, so a store kernel on fewer threads leaves cores
    idle (with CPUs - 1 the cluster kept 1.13 of 2 cores busy in compute-bound decode). The
    kernels cut a call into chunks that the calling thread and the pool's helpers claim from an
    atomic counter, so a helper the OS does not schedule (the worker's shared expert overlaps
    the call) delays no call by much."""
    return default_threads()


def shape_of(container: Container) -> ModelShape:
    a = container.args
    return ModelShape(model_id=container.index.identity, arch=a.arch, hidden_size=a.hidden_size,
                      moe_layers=tuple(a.moe_layer_ids), n_experts=a.n_routed_experts,
                      top_k=a.num_experts_per_tok, record_bytes=container.layout.record_bytes,
                      expert_dtype=str(container.quantization["experts"]))


class StoreCore:
    def __init__(self, settings: Settings, *, threads: int | None = None,
                 history_interval_s: float = 30.0) -> None:
        """threads: kernel threads per call (default: `kernel_threads()`).
        history_interval_s: how often the learned policy's usage history is saved."""
        if settings.model.path is None:
            raise InvalidArgument("the expert store needs a model directory (--model or model.path)")
        st = settings.storage
        if st.mirror_weights and len(st.mirror_weights) != 1 + len(st.mirrors):
            raise InvalidArgument(f"storage.mirror_weights: {len(st.mirror_weights)} weights for the primary and "
                                  f"{len(st.mirrors)} mirrors (need {1 + len(st.mirrors)})")
        self.settings = settings
        self.store_id = settings.expert_store.id
        self.history_interval_s = history_interval_s
        self.ops = FastOps(threads=threads if threads is not None else kernel_threads())
        self.container = Container.open(settings.model.path, partial_experts=True)
        try:
            self.shape = shape_of(self.container)
            index = owned_index(self.container, st.owned_experts, self.store_id)
            self.owned = to_ranges(index.records)
            config = tier_config(settings, index.total_bytes, self.store_id)
            if config.history_path is not None:
                config.history_path.parent.mkdir(parents=True, exist_ok=True)
            self.tier = ExpertTier.open(index, config, mirrors=st.mirrors,
                                        depth=st.queue_depth, direct=st.direct_io,
                                        mirror_weights=st.mirror_weights or None,
                                        read_delay=ReadDelay(st.test_read_delay_file)
                                        if st.test_read_delay_file is not None else None)
            self.experts = TierCompute(self.tier, self.ops)
        except BaseException:
            self.container.close()
            raise
        # A few compute threads, each running one call's loop: a call waiting for its reads holds a
        # thread, not the others' calls. The kernels spread a call over `ops.threads` cores
        # themselves; a second call computing meanwhile runs on its own thread (the kernels' pool
        # has one owner at a time), so concurrent calls share the cores without stalling.
        self._compute = ThreadPoolExecutor(max_workers=COMPUTE_THREADS, thread_name_prefix="moetier-compute")
        self._queued = 0  # jobs submitted to the compute threads and not finished (inline ones wait for none)
        self._queued_lock = threading.Lock()
        self._row = {layer: i for i, layer in enumerate(self.shape.moe_layers)}
        n_layers, n_experts = len(self.shape.moe_layers), self.shape.n_experts
        self._held = np.zeros((n_layers, n_experts), dtype=bool)  # [L, E] this store's shard
        for layer, expert in index.records:
            self._held[self._row[layer], expert] = True
        self.read_bandwidth = 0.0
        self._counts = np.zeros((n_layers, n_experts), dtype=np.uint32)
        self._recent = np.zeros((n_layers, n_experts), dtype=np.uint8)
        self._step = 0
        self._hints_refused = 0  # hinted experts dropped here: stale step or prefetch disabled
        self._placement: tuple[tuple[object, ...], npt.NDArray[np.uint8]] | None = None
        self._saver: asyncio.Task[None] | None = None
        self._notes = threading.Lock()  # step and routing notes: the event loop and the lane threads
        self.metrics = StoreMetrics(self.tier_stats, self.shape.moe_layers, config.policy)
        log.info("expert store %s: %s (%s, %d MoE layers x %d experts, %d-byte records), holds %d of %d experts, "
                 "budget %d bytes, policy %s, %d mirror(s), %s", self.store_id, settings.model.path, self.shape.arch,
                 n_layers, n_experts, self.shape.record_bytes, len(index), n_layers * n_experts, self.tier.budget,
                 config.policy, len(st.mirrors), self.ops)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Warm the kernels (no first request pays for it), read every expert where the budget holds
        them all (storage.preload), and start saving usage history."""
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._compute, self._warm)
        log.info("kernels warm (%s) in %.2f s", self.ops, time.perf_counter() - t0)
        if self.settings.storage.share:
            self.tier.use_shared_memory()  # a roomy tier reads into shared memory from now on
        if self.settings.storage.preload:
            t0 = time.perf_counter()
            n, nbytes, failed = await asyncio.to_thread(self.tier.preload)
            if n or failed:
                log.info("preloaded %d experts (%.2f GB, the whole budget holds them) in %.2f s%s", n, nbytes / 1e9,
                         time.perf_counter() - t0, f"; {failed} reads failed (read again on demand)" if failed else "")
        shared = self.tier.share() if self.settings.storage.share else None
        if shared is not None:
            log.info("sharing %d experts (%.2f GB) with dense workers on this host", len(shared.table),
                     shared.size / 1e9)
        if self.tier.config.history_path is not None and self._saver is None:
            self._saver = asyncio.get_running_loop().create_task(self._save_history_periodically(),
                                                                  name="expert-history-saver")

    def _warm(self) -> None:
        """On the compute thread: every kernel once, then a MoE call through this store's ops in
        the model's expert dtype (the kernels' thread team starts here, not on a request)."""
        warmup()
        rng = np.random.default_rng(0)
        g = int(self.container.quantization["group_size"])
        dtype = cast(QDType, self.shape.expert_dtype)
        d = 2 * g  # [I, D] = [8, 2g]: tiny, but the model's dtype and group size
        gate, up, down = (quantize(rng.standard_normal(s, dtype=np.float32), dtype, g)
                          for s in ((8, d), (8, d), (d, 8)))
        ew = ExpertWeights(gate, up, down)
        x = rng.standard_normal((2, d), dtype=np.float32)
        self.ops.moe(x, np.zeros((2, 1), dtype=np.int32), np.ones((2, 1), dtype=np.float32), {0: ew})

    async def stop(self) -> None:
        """Stop the saver, finish running computes, close the tier (saving history) and the container."""
        if self._saver is not None:
            self._saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._saver
            self._saver = None
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Synchronous part of `stop` (also for a store that never started)."""
        self._compute.shutdown(wait=True)
        self.tier.close()
        self.container.close()

    async def _save_history_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.history_interval_s)
            try:
                await asyncio.to_thread(self.tier.save_history)
            except OSError as e:
                log.warning("could not save usage history to %s: %s", self.tier.config.history_path, e)

    # ---- requests -------------------------------------------------------------------
    def probe_bandwidth(self) -> float:
        """Measure the read bandwidth of this store's copies (a few records each), bytes/s: the
        weight of its share in the router's placement map. Configured copy weights
        (`storage.mirror_weights`, GB/s) are taken as they are instead."""
        weights = self.settings.storage.mirror_weights
        self.read_bandwidth = sum(weights or self.tier.engine.probe()) * 1e9
        return self.read_bandwidth

    def _check_held(self, batch: ComputeBatch) -> None:
        ids = batch.ids[batch.ids >= 0] if batch.slot_outputs else batch.ids.reshape(-1)
        held = self._held[self._row[batch.layer]]
        if not held[ids].all():
            missing = np.unique(ids[~held[ids]])
            raise NotFound(f"expert store {self.store_id} does not hold layer {batch.layer} experts "
                           f"{missing[:16].tolist()}{' ...' if len(missing) > 16 else ''} (it holds "
                           f"{int(held.sum())} of the layer's {len(held)})")

    async def compute(self, batch: ComputeBatch) -> ComputeResult:
        """One MoE layer for a batch: the tier-compute loop, on the event loop's thread when the
        call is small, no compute thread busy and every expert of it resident (see INLINE_ROWS),
        else on a compute thread, which may wait for reads and for room in the budget. Only
        running calls hold pins (a call queued for a thread holds none, and a call waits for room
        only between waves, holding nothing), so a wave waiting for room never waits for a call
        that waits for it. The batch was checked against `shape`."""
        self._check_held(batch)
        self._note_step(batch.step)
        self._note_routing(batch.layer, batch.ids)
        job = None
        if batch.hidden.shape[0] <= INLINE_ROWS and self._queued == 0:
            job = self.experts.start(batch.layer, batch.hidden, batch.ids, batch.weights, block=False,
                                     slot_outputs=batch.slot_outputs)
        if job is not None and job.resident:
            result = self.experts.finish(job)  # a decode step's few rows: without two thread hand-offs
        else:
            result = await self._on_compute_thread(batch, job)
        self.metrics.observe_compute(batch.layer, batch.hidden.shape[0], result.waves, result.load_ns,
                                     result.compute_ns)
        return result

    def compute_here(self, batch: ComputeBatch) -> ComputeResult:
        """`compute` on the calling thread (a local lane connection's, which is there to compute
        its calls): the tier-compute loop run here, its waits for reads and room included. The
        batch was checked against `shape`."""
        self._check_held(batch)
        self._note_step(batch.step)
        self._note_routing(batch.layer, batch.ids)
        result = self.experts.run(batch.layer, batch.hidden, batch.ids, batch.weights, slot_outputs=batch.slot_outputs)
        self.metrics.observe_compute(batch.layer, batch.hidden.shape[0], result.waves, result.load_ns,
                                     result.compute_ns)
        return result

    async def _on_compute_thread(self, batch: ComputeBatch, job: ComputeJob | None) -> ComputeResult:
        """`finish` (and `start`, unless the job was started here) on a compute thread. A cancelled
        caller leaves nothing pinned: a job not yet started is abandoned here, one that waits for
        room is abandoned by the thread once it has it, one computing releases when done."""
        gone = threading.Event()

        def work() -> ComputeResult:
            j = job or self.experts.start(batch.layer, batch.hidden, batch.ids, batch.weights, block=True,
                                          slot_outputs=batch.slot_outputs)
            assert j is not None
            if gone.is_set():
                j.abandon()
                raise asyncio.CancelledError
            return self.experts.finish(j)

        with self._queued_lock:
            self._queued += 1
        fut = self._compute.submit(work)
        fut.add_done_callback(self._dequeue)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            gone.set()
            if fut.cancelled() and job is not None:  # never started: nobody else will release
                job.abandon()
            raise

    def _dequeue(self, _: Future[Any]) -> None:
        with self._queued_lock:
            self._queued -= 1

    def prefetch(self, hint: PrefetchHint) -> PrefetchResult:
        n = len(np.unique(hint.ids))
        held = self._held[self._row[hint.layer]][hint.ids]
        if not held.all():  # hints never fail: experts of another store's shard are dropped
            with self._notes:
                self._hints_refused += len(np.unique(hint.ids[~held]))
            hint = PrefetchHint(hint.layer, hint.ids[held], hint.step)
            n = len(np.unique(hint.ids))
        stale = hint.step is not None and hint.step < self._step
        if stale or not self.settings.storage.prefetch:
            with self._notes:
                self._hints_refused += n
            return PrefetchResult(queued=0, resident=0, dropped=n)
        self._note_step(hint.step)
        out = self.tier.hint(hint.layer, hint.ids)
        return PrefetchResult(queued=out.queued, resident=out.present, dropped=out.dropped)

    def shared_offer(self) -> SharedOffer | None:
        """What the local lane offers callers that compute from this store's memory (`tier.share`,
        done at start), or None."""
        shared = self.tier.shared
        if shared is None:
            return None
        return SharedOffer(shared.fd, shared.size, shared.table, self.container.index.identity)

    def note_shared(self, usage: SharedUsage) -> None:
        """Calls a dense worker computed from the shared experts, counted as this store's own:
        routing heat, the tier's hits and usage, calls and rows per layer."""
        for layer, experts, uses, slots in usage.experts:
            if not self._held[self._row[layer]][experts].all():
                raise NotFound(f"expert store {self.store_id}: usage of layer {layer} experts it does not hold")
            self.tier.note_shared(layer, experts, uses)
            row = self._row[layer]
            with self._notes:
                np.add.at(self._counts[row], experts, slots.astype(np.uint32))
                self._recent[row] = 0
                self._recent[row, experts] = 1
        for layer, calls, rows in usage.layers:
            self.metrics.observe_shared(layer, calls, rows)

    def _note_step(self, step: int | None) -> None:
        with self._notes:
            if step is None or step <= self._step:
                return
            # each step ages queued prefetch reads; past prefetch_max_age more steps change nothing
            for _ in range(min(step - self._step, self.tier.config.prefetch_max_age + 1)):
                self.tier.new_step()
            self._step = step

    def _note_routing(self, layer: int, ids: I32) -> None:
        row = self._row[layer]
        flat = ids.reshape(-1)
        flat = flat[flat >= 0]  # slots of other stores (slot_outputs) are theirs to count
        with self._notes:
            self._counts[row] += np.bincount(flat, minlength=self.shape.n_experts).astype(np.uint32)
            self._recent[row] = 0
            self._recent[row, flat] = 1

    # ---- observation ----------------------------------------------------------------
    def tier_stats(self) -> TierStats:
        """The tier's stats, with the hints this layer dropped (stale, prefetch off) counted in."""
        s = self.tier.stats()
        s.prefetch_hints += self._hints_refused
        s.prefetch_dropped += self._hints_refused
        return s

    def info(self) -> StoreInfo:
        return StoreInfo(self.shape, self.tier.budget, self.tier.config.policy, self.tier.engine.stats().disks,
                         self.store_id, self.owned, self.read_bandwidth)

    async def aheat(self) -> StoreHeat:
        # off the event loop: placing every expert of a large model takes a while the first time
        return await asyncio.to_thread(self.heat)

    def heat(self) -> StoreHeat:
        snap = self.tier.heat()  # rows: the layers of this store's shard; an expert being read is on disk
        state = np.zeros(self._held.shape, dtype=np.uint8)
        for i, layer in enumerate(snap.layers.tolist()):
            state[self._row[layer], :snap.state.shape[1]] = snap.state[i]
        in_ram = (state == HEAT_RAM) | (state == HEAT_PINNED)
        tier = np.where(in_ram, 0, 1 + self._placement_map()).astype(np.uint8)
        tier[~self._held] = NOT_HELD
        stats = self.tier.stats()
        return StoreHeat(self.shape.moe_layers, self._counts.copy(), tier, self._recent.copy(),
                         [d.name for d in stats.io.disks] if stats.io else [], stats.resident_bytes,
                         stats.budget_bytes, self._step)

    def _placement_map(self) -> npt.NDArray[np.uint8]:
        """[L, E] index of the copy the next read of each expert would try first; recomputed
        only when a copy's health, weight or files change."""
        copies = self.tier.engine.copies
        key = tuple((c.stats.state, c.stats.weight, c.stats.files) for c in copies.copies)
        if self._placement is not None and self._placement[0] == key:
            return self._placement[1]
        where = np.zeros((len(self.shape.moe_layers), self.shape.n_experts), dtype=np.uint8)
        if len(copies.copies) > 1:
            position = {id(c): i for i, c in enumerate(copies.copies)}
            for (layer, expert), loc in self.tier.index.records.items():
                where[self._row[layer], expert] = position[id(copies.order((layer, expert), loc)[0])]
        self._placement = (key, where)
        return where
