"""The I/O engine: single-flight, batches, priorities, checksums, O_DIRECT vs buffered, asyncio."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers_store import REC, Disk, corrupt, file_bytes, records, restore, wait_for

from moetier.errors import DataCorruption, InvalidArgument, NotFound
from moetier.store.io import DEMAND, PREFETCH, IOEngine
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.index import ExpertIndex


@pytest.fixture
def index(tmp_path: Path) -> ExpertIndex:
    return records(tmp_path)


def test_reads_verified_record_bytes(index: ExpertIndex) -> None:
    with IOEngine(index, depth=2) as eng:
        got = eng.read([(1, 0), (2, 7)])
        for k, buf in got.items():
            assert buf.ctypes.data % 4096 == 0  # page-aligned (O_DIRECT)
            assert bytes(buf[: index.records[k].length]) == file_bytes(index, k)
        with pytest.raises(NotFound, match="no expert 9 in layer 1"):
            eng.submit((1, 9))
    with pytest.raises(InvalidArgument):
        IOEngine(index, depth=0)


def test_direct_and_buffered_reads_give_identical_bytes(index: ExpertIndex) -> None:
    with IOEngine(index, depth=2, direct=True) as d, IOEngine(index, depth=2, direct=False) as b:
        assert not b.direct and not b.stats().disks[0].direct
        if not d.direct:
            pytest.skip("this filesystem refuses O_DIRECT (the engine fell back to buffered reads)")
        keys = list(index.records)
        got_d, got_b = d.read(keys), b.read(keys)
        for k in keys:
            n = index.records[k].length
            assert bytes(got_d[k][:n]) == bytes(got_b[k][:n]) == file_bytes(index, k)


def test_single_flight_engine(index: ExpertIndex) -> None:
    with IOEngine(index, depth=4) as eng:
        disk = Disk(eng, hold=True)
        futs = [eng.submit((1, 3)) for _ in range(16)]
        disk.gate.set()
        bufs = [f.result(5) for f in futs]
        assert disk.reads() == 1 and all(b is bufs[0] for b in bufs)
        s = eng.stats()
        assert (s.submitted, s.joined, s.reads) == (1, 15, 1)


def test_single_flight_tier_16_threads(index: ExpertIndex) -> None:
    """16 threads missing one cold expert at once cause exactly one disk read."""
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=4) as tier:
        disk = Disk(tier.engine, hold=True)
        start = threading.Barrier(16)
        results: list[bytes] = []
        errors: list[BaseException] = []

        def worker() -> None:
            start.wait()
            try:
                with tier.acquire(1, [3]) as ex:
                    results.append(bytes(ex[3]))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(tier.stats().misses.values()) == 16)
        disk.gate.set()
        for t in threads:
            t.join()
        assert not errors and len(results) == 16
        assert disk.reads() == 1 and tier.stats().io.reads == 1
        assert set(results) == {file_bytes(index, (1, 3))}


def test_batch_misses_are_issued_together(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=8 * REC), depth=4) as tier:
        disk = Disk(tier.engine, hold=True)
        done = threading.Event()

        def acquire() -> None:
            with tier.acquire(2, [0, 1, 2, 3]):
                done.set()

        t = threading.Thread(target=acquire)
        t.start()
        disk.wait_active(4)  # every miss of the batch is in flight before any completes
        disk.gate.set()
        t.join()
        assert done.is_set() and disk.peak == 4 and tier.stats().io.peak_inflight == 4


def test_demand_reads_go_before_queued_prefetch_reads(index: ExpertIndex) -> None:
    with IOEngine(index, depth=1) as eng:
        disk = Disk(eng, hold=True)
        first = eng.submit((1, 0))
        disk.wait_active(1)  # the only worker is busy
        pre = [eng.submit((1, e), PREFETCH) for e in (1, 2)]
        dem = eng.submit((2, 5), DEMAND)
        promoted = eng.submit((1, 2), DEMAND)  # a demand request promotes a queued prefetch
        assert promoted is pre[1]
        disk.gate.set()
        for f in (first, *pre, dem):
            f.result(5)
        offsets = [c[2] for c in disk.calls]
        loc = index.records
        assert offsets == [loc[(1, 0)].offset, loc[(2, 5)].offset, loc[(1, 2)].offset, loc[(1, 1)].offset]


def test_cancel_only_drops_queued_prefetch(index: ExpertIndex) -> None:
    with IOEngine(index, depth=1) as eng:
        disk = Disk(eng, hold=True)
        eng.submit((1, 0))
        disk.wait_active(1)
        p = eng.submit((1, 1), PREFETCH)
        d = eng.submit((1, 2), DEMAND)
        assert not eng.cancel((1, 2)) and not eng.cancel((1, 0))
        assert eng.cancel((1, 1)) and p.cancelled()
        disk.gate.set()
        d.result(5)
        assert eng.stats().cancelled == 1 and disk.reads() == 2


def test_corrupt_primary_served_from_mirror(tmp_path: Path, index: ExpertIndex) -> None:
    import shutil

    shutil.copytree(index.root, tmp_path / "mirror")
    orig = corrupt(index.root, index.records[(1, 3)])
    # weights steer reads to the primary first, so the corruption is met, then the mirror serves
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=2, mirrors=[tmp_path / "mirror"],
                         mirror_weights=[1.0, 1e-9]) as tier:
        with tier.acquire(1, [3]) as ex:
            assert bytes(ex[3]) == orig
        s = tier.stats().io
        assert s is not None
        assert s.checksum_failures == 1 and s.fallbacks == 1 and s.corrupt == 0
        assert s.disks[0].checksum_failures == 1 and s.disks[1].reads == 1
        assert s.disks[1].state == "ok"  # one bad record does not degrade a copy


def test_corrupt_without_valid_copy_fails_loudly_and_poisons_nothing(index: ExpertIndex) -> None:
    loc = index.records[(1, 3)]
    orig = corrupt(index.root, loc)
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=2) as tier:
        with pytest.raises(DataCorruption) as ei, tier.acquire(1, [2, 3, 4]):
            pass
        msg = str(ei.value)
        assert "layer 1" in msg and "expert 3" in msg and str(index.root / loc.path) in msg
        assert f"offset {loc.offset}" in msg
        # other experts keep being served, from the same batch and others
        with tier.acquire(1, [2, 4, 5]) as ex:
            assert bytes(ex[5]) == file_bytes(index, (1, 5))
        s = tier.stats()
        assert s.failed_loads == 1 and s.io is not None and s.io.corrupt == 1
        assert (1, 3) not in tier.resident()
        tier.check_invariants()
        # nothing remembered: once the record is repaired, the next acquire reads it again
        restore(index.root, loc, orig)
        with tier.acquire(1, [3]) as ex:
            assert bytes(ex[3]) == orig


async def test_async_api_and_cancelled_awaiter_does_not_cancel_shared_read(index: ExpertIndex) -> None:
    with ExpertTier.open(index, TierConfig(budget_bytes=4 * REC), depth=2) as tier:
        eng = tier.engine
        got = await eng.aread([(1, 0), (1, 1)])
        assert bytes(got[(1, 1)][:REC]) == file_bytes(index, (1, 1))
        disk = Disk(eng, hold=True)
        a = asyncio.create_task(eng.aread([(2, 2)]))
        b = asyncio.create_task(eng.aread([(2, 2)]))
        await asyncio.to_thread(disk.wait_active, 1)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        disk.gate.set()
        assert bytes((await b)[(2, 2)][:REC]) == file_bytes(index, (2, 2))
        with tier.acquire(2, np.array([[2, 3], [3, 4]])) as ex:
            assert sorted(ex) == [2, 3, 4]
        assert tier.stats().pinned_experts == 0


def test_filesystem_refusing_o_direct_falls_back_to_buffered(
        index: ExpertIndex, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import logging
    import os

    real_open = os.open

    def no_direct(path: object, flags: int, *a: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING), IOEngine(index, depth=1) as eng:
        assert not eng.direct
        assert bytes(eng.read([(2, 3)])[(2, 3)][:REC]) == file_bytes(index, (2, 3))
    assert any("buffered reads" in r.getMessage() and "O_DIRECT" in r.getMessage() for r in caplog.records)


def test_bench_io_without_fio_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from moetier.cli import main

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert main(["bench", "io"]) != 0
    assert "apt-get install -y fio" in capsys.readouterr().err
