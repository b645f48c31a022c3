"""The RAM tier: budget, pins, policies, prefetch accounting, history, the in-process provider."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers_store import REC, Disk, file_bytes, records, wait_for

from moetier.errors import ResourceExhausted
from moetier.model.experts import DictExperts
from moetier.model.forward import Model
from moetier.model.ops import ReferenceOps
from moetier.store.policy import make_policy
from moetier.store.provider import TieredExperts
from moetier.store.sim import simulate
from moetier.store.stats import HEAT_DISK, HEAT_PINNED, HEAT_RAM
from moetier.store.tier import ExpertTier, TierConfig
from moetier.store.trace import SynthSpec, temporal_trace
from moetier.weights.index import ExpertIndex


@pytest.fixture
def index(tmp_path: Path) -> ExpertIndex:
    return records(tmp_path)


@pytest.mark.parametrize("policy", ["lru", "lfu", "learned"])
def test_budget_never_exceeded_randomized(tmp_path: Path, policy: str) -> None:
    """Random acquires (some held across others), prefetches and steps, from two threads;
    mixed record sizes; the bookkeeping is recounted and the budget checked after every op."""
    index = records(tmp_path, n_experts=12, record_bytes=lambda k: 4096 * (1 + (k[0] * 7 + k[1]) % 3))
    budget = 10 * 4096
    with ExpertTier.open(index, TierConfig(budget_bytes=budget, policy=policy, pin_wait_s=0.2), depth=3) as tier:
        errors: list[BaseException] = []

        def run(seed: int) -> None:
            rng = random.Random(seed)
            held = []
            try:
                for _ in range(150):
                    op = rng.random()
                    layer = rng.choice(index.layers)
                    ids = rng.sample(range(12), rng.randint(1, 3))
                    if op < 0.6:
                        try:
                            with tier.acquire(layer, ids) as ex:
                                for e in ids:
                                    assert bytes(ex[e]) == file_bytes(index, (layer, e))
                        except ResourceExhausted:
                            pass  # the other thread's pins may not leave room: refused, never exceeded
                    elif op < 0.7 and len(held) < 1:
                        with contextlib.suppress(ResourceExhausted):
                            held.append(tier.pin(layer, ids[:1]))
                    elif op < 0.8 and held:
                        held.pop().release()
                    elif op < 0.95:
                        tier.prefetch(layer, ids)
                    else:
                        tier.new_step()
                    tier.check_invariants()
                    s = tier.stats()
                    assert s.resident_bytes + s.loading_bytes <= budget
            except BaseException as e:
                errors.append(e)
            finally:
                for lease in held:
                    lease.release()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        wait_for(lambda: tier.stats().loading_experts == 0)
        tier.check_invariants()
        s = tier.stats()
        assert s.pinned_experts == 0 and s.evictions > 0


def test_pinned_experts_are_never_evicted(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC, pin_wait_s=0.05), depth=2) as tier:
        lease = tier.pin(1, [0, 1])
        before = {e: bytes(v) for e, v in lease.experts.items()}
        for i in range(40):
            with tier.acquire(2, [i % 8, (i + 3) % 8]):
                pass
            assert {(1, 0), (1, 1)} <= tier.resident()
        assert {e: bytes(v) for e, v in lease.experts.items()} == before  # buffers never reused under a pin
        assert tier.stats().evictions > 10
        with pytest.raises(ResourceExhausted, match=r"budget of 32768 bytes exhausted: 16384 bytes pinned"):
            tier.pin(2, [5, 6, 7])  # 16 KiB pinned + 24 KiB needed > 32 KiB: refused after waiting
        with pytest.raises(ResourceExhausted, match="needs 5 experts"):
            tier.pin(2, [0, 1, 2, 3, 4])  # larger than the whole budget: refused at once
        lease.release()
        with tier.acquire(2, [5, 6, 7]):
            pass
        tier.check_invariants()


def test_acquire_waits_for_another_compute_to_unpin(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=3 * REC, pin_wait_s=5.0), depth=2) as tier:
        lease = tier.pin(1, [0, 1])
        threading.Timer(0.1, lease.release).start()
        with tier.acquire(1, [2, 3]) as ex:  # needs room the lease holds
            assert sorted(ex) == [2, 3]


def test_evicted_buffers_are_reused_only_when_unreferenced(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=2 * REC), depth=1) as tier:
        with tier.acquire(1, [0]) as ex:
            kept = ex[0]  # a caller still holding an expert after its compute
        want = bytes(kept)
        for e in range(1, 8):
            with tier.acquire(1, [e]):
                pass
        assert bytes(kept) == want  # its buffer was not recycled under it
        assert tier.stats().io.buffers_reused > 0  # type: ignore[union-attr]


def test_a_burst_of_evictions_keeps_its_buffers_for_the_reads_it_makes_room_for(index: ExpertIndex) -> None:
    """Waves of four new experts into a full tier whose pool keeps one idle buffer: the
    evictions that make room keep their buffers for the four reads (no buffer is mapped
    once the budget is filled), the idle buffers never hold more than the budget leaves,
    and every record read is its file's bytes."""
    budget = 6 * REC
    with ExpertTier.open(index, TierConfig(budget_bytes=budget), depth=1, free_buffers=1) as tier:
        for e0 in (0, 4):
            with tier.acquire(1, range(e0, e0 + 4)):
                pass
        io = tier.stats().io
        filled, reused = io.buffers_allocated, io.buffers_reused  # type: ignore[union-attr]
        for _ in range(3):
            for e0 in (0, 4):
                with tier.acquire(1, range(e0, e0 + 4)) as ex:
                    assert {e: bytes(v) for e, v in ex.items()} == {e: file_bytes(index, (1, e))
                                                                    for e in range(e0, e0 + 4)}
                del ex  # (a record still held is never recycled)
                s = tier.stats()
                assert s.resident_bytes + tier.engine.pool.free_buffers * REC <= budget
        s = tier.stats()
        assert s.io.buffers_allocated == filled  # type: ignore[union-attr]
        # each wave finds at most two of its four experts left by the one before (six fit)
        assert s.io.buffers_reused - reused >= 6 * 2  # type: ignore[union-attr]


def test_prefetch_useful_wasted_and_dropped(index: ExpertIndex) -> None:
    cfg = TierConfig(budget_bytes=6 * REC, prefetch_limit=2, prefetch_max_age=1)
    with ExpertTier.open(index, cfg, depth=1) as tier:
        assert tier.prefetch(1, [0, 1]) == 2
        wait_for(lambda: tier.stats().loading_experts == 0)
        with tier.acquire(1, [0]):
            pass
        s = tier.stats()
        assert (s.prefetch_issued, s.prefetch_useful, s.prefetch_wasted) == (2, 1, 0)
        assert s.hits[1] == 1 and s.misses[1] == 0
        for e in range(2, 8):  # churn: (1, 1) is evicted without ever being used
            with tier.acquire(2, [e]):
                pass
        assert (1, 1) not in tier.resident()
        assert tier.stats().prefetch_wasted == 1

        disk = Disk(tier.engine, hold=True)
        busy = tier.engine.submit((1, 6))  # occupies the only worker: later reads stay queued
        disk.wait_active(1)
        assert tier.prefetch(1, [2, 3, 4]) == 2  # bounded: the third is dropped
        assert tier.stats().prefetch_dropped == 1
        tier.prefetch(1, [3])  # a newer hint for layer 1 supersedes the queued read of (1, 2)
        s = tier.stats()
        assert s.prefetch_dropped == 2 and s.loading_experts == 1
        tier.new_step()
        tier.new_step()  # older than prefetch_max_age: dropped before it is read
        assert tier.stats().prefetch_dropped == 3 and tier.stats().loading_experts == 0
        disk.gate.set()
        busy.result(5)
        tier.check_invariants()


def test_learned_history_survives_restart_and_torn_file_is_ignored(
        index: ExpertIndex, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hist = tmp_path / "usage.hist"
    cfg = TierConfig(budget_bytes=4 * REC, policy="learned", learned_fraction=0.5, history_path=hist)
    with ExpertTier.open(index, cfg, depth=1) as tier:
        for _ in range(30):
            with tier.acquire(1, [5]):
                pass
            with tier.acquire(2, [6]):
                pass
        with tier.acquire(1, [0]):
            pass
        saved = tier.policy.history().copy()  # type: ignore[attr-defined]
    assert hist.exists()
    with ExpertTier.open(index, cfg, depth=1) as tier:
        loaded = tier.policy.history()  # type: ignore[attr-defined]
        np.testing.assert_allclose(loaded, saved, rtol=1e-6)
        with tier.acquire(1, [5]), tier.acquire(2, [6]):
            pass
        assert tier.policy.protected() == 2  # the hot experts are protected from the first access on

    data = hist.read_bytes()
    for bad in (data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 1])):
        hist.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING), ExpertTier.open(index, cfg, depth=1) as tier:
            assert not tier.policy.history().any()  # type: ignore[attr-defined]
        assert any("ignored" in r.getMessage() for r in caplog.records)


def test_heat_snapshot(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=1) as tier:
        with tier.acquire(1, [2, 3]):
            pass
        with tier.acquire(1, [3]):
            h = tier.heat()
        assert h.layers.tolist() == [1, 2] and h.uses.shape == (2, 8) and h.state.dtype == np.uint8
        assert h.uses[0, 3] == 2 and h.uses[0, 2] == 1 and h.uses[1].sum() == 0
        assert h.state[0, 3] == HEAT_PINNED and h.state[0, 2] == HEAT_RAM and h.state[1, 0] == HEAT_DISK
        assert tier.stats().hits[1] == 1


def test_tier_hits_equal_the_simulator(index: ExpertIndex) -> None:
    """The cache benchmark's simulator and the live tier make the same decisions."""
    spec = SynthSpec(layers=2, n_experts=8, top_k=2, batch=2, steps=60)
    trace = [[(layer + 1, ids) for layer, ids in step] for step in temporal_trace(spec, seed=3)]
    for policy in ("lru", "lfu", "learned"):
        with ExpertTier.open(index, TierConfig(budget_bytes=5 * REC, policy=policy), depth=2) as tier:
            for step in trace:
                for layer, ids in step:
                    with tier.acquire(layer, ids):
                        pass
            s = tier.stats()
        hits, total = simulate(make_policy(policy, [1, 2], 8, 5), trace, 5)
        assert (sum(s.hits.values()), sum(s.hits.values()) + sum(s.misses.values())) == (hits, total), policy


def test_tiered_model_equals_in_memory_model(tmp_path: Path) -> None:
    from moetier.convert import synth
    from moetier.weights.container import Container

    c = Container.open(synth.write_container("tiny-qwen3_moe", tmp_path / "m", 0))
    ops = ReferenceOps()
    dense = {n: c.dense(n) for n in c.dense_names()}
    everything = {(li, e): c.read_expert(li, e) for li in c.args.moe_layer_ids for e in range(c.args.n_routed_experts)}
    ref = Model(c.args, dense, ops, DictExperts(everything, ops))
    # room for 8 of 16 experts (a layer may need all 8 of its own): steps evict and re-read
    cfg = TierConfig(budget_bytes=8 * c.layout.record_bytes, policy="learned")
    with TieredExperts.open(c, ops, cfg, depth=2) as experts:
        tiered = Model(c.args, dense, ops, experts)
        rng = np.random.default_rng(0)
        caches = [ref.new_cache(), tiered.new_cache()]
        prompt = rng.integers(0, c.args.vocab_size, 6)
        a, b = ref.step([(caches[0], prompt)])[0], tiered.step([(caches[1], prompt)])[0]
        assert np.array_equal(a, b)
        for _ in range(4):
            tok = np.array([int(np.argmax(a))])
            a, b = ref.step([(caches[0], tok)])[0], tiered.step([(caches[1], tok)])[0]
            assert np.array_equal(a, b)
        s = experts.tier.stats()
        assert s.evictions > 0 and s.prefetch_hints > 0 and s.io is not None and s.io.checksum_failures == 0
    c.close()


def test_a_settled_tier_stops_the_models_hints(tmp_path: Path) -> None:
    """A tier whose budget holds every expert settles after SETTLE_STEPS steps without a miss and
    a miss unsettles it; one a record short never settles. A settled tier is sent no hints, and
    the logits are those of the model that goes on hinting."""
    from moetier.convert import synth
    from moetier.store.tier import SETTLE_STEPS
    from moetier.weights.container import Container

    c = Container.open(synth.write_container("tiny-qwen3_moe", tmp_path / "m", 0))
    ops = ReferenceOps()
    dense = {n: c.dense(n) for n in c.dense_names()}
    layers, n = c.args.moe_layer_ids, c.args.n_routed_experts
    short = TierConfig(budget_bytes=(len(layers) * n - 1) * c.layout.record_bytes, policy="lru")
    full = TierConfig(budget_bytes=len(layers) * n * c.layout.record_bytes, policy="lru")
    with TieredExperts.open(c, ops, full, depth=2) as experts, TieredExperts.open(c, ops, short, depth=2) as tight:
        for tiered in (experts, tight):
            with tiered.tier.acquire(layers[0], [0]):  # a miss
                pass
            for step in range(SETTLE_STEPS + 2):
                assert tiered.wants_hints() == (tiered is tight or step < SETTLE_STEPS), step
                tiered.tier.new_step()
                with tiered.tier.acquire(layers[0], [0]):  # a hit
                    pass
        assert experts.tier.settled() and not tight.tier.settled()
        with experts.tier.acquire(layers[-1], [n - 1]):  # a miss unsettles
            pass
        assert not experts.tier.settled() and experts.wants_hints()
        for li in layers:  # everything resident, then settled again
            with experts.tier.acquire(li, range(n)):
                pass
        for _ in range(SETTLE_STEPS):
            experts.tier.new_step()
        assert experts.tier.settled()
        quiet, hinting = Model(c.args, dense, ops, experts), Model(c.args, dense, ops, tight)
        caches = [quiet.new_cache(), hinting.new_cache()]
        prompt = np.random.default_rng(1).integers(0, c.args.vocab_size, 5)
        before = (experts.tier.stats().prefetch_hints, tight.tier.stats().prefetch_hints)
        a, b = quiet.step([(caches[0], prompt)])[0], hinting.step([(caches[1], prompt)])[0]
        for _ in range(3):
            assert np.array_equal(a, b)
            tok = np.array([int(np.argmax(a))])
            a, b = quiet.step([(caches[0], tok)])[0], hinting.step([(caches[1], tok)])[0]
        assert np.array_equal(a, b)
        assert experts.tier.stats().prefetch_hints == before[0], "a settled tier was sent hints"
        assert tight.tier.stats().prefetch_hints > before[1]
    c.close()


def test_record_that_does_not_parse_fails_only_its_acquires(tmp_path: Path) -> None:
    from moetier.errors import FormatError

    def parse(buf: np.ndarray) -> bytes:
        if buf[0] == 0xAB:
            raise ValueError("bad part header")
        return bytes(buf)

    index = records(tmp_path, fill=lambda k, rng: b"\xab" if k == (1, 2) else b"\x01", parse=parse)
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=1) as tier:
        with pytest.raises(FormatError, match="layer 1 expert 2: record does not parse"), tier.acquire(1, [1, 2]):
            pass
        with tier.acquire(1, [1, 3]) as ex:
            assert ex[1][:1] == b"\x01"
        assert tier.stats().failed_loads == 1 and (1, 2) not in tier.resident()
        tier.check_invariants()
