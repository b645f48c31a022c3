"""Mirrors: start-up validation, partial copies, weighted placement, degradation and recovery."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers_store import Disk, file_bytes, records

from moetier.store.io import IOEngine
from moetier.weights.index import ExpertIndex


@pytest.fixture
def index(tmp_path: Path) -> ExpertIndex:
    return records(tmp_path, layers=(1, 2, 3), n_experts=16)


def test_partial_mirror_serves_only_valid_files(tmp_path: Path, index: ExpertIndex) -> None:
    m = tmp_path / "mirror"
    m.mkdir()
    shutil.copy(index.root / "layer-001.bin", m)
    with open(m / "layer-002.bin", "wb") as f:  # half-copied file: wrong size, not used
        f.write((index.root / "layer-002.bin").read_bytes()[:8192])
    with IOEngine(index, depth=2, mirrors=[m], mirror_weights=[1.0, 1.0]) as eng:
        disk = Disk(eng)
        assert eng.stats().disks[1].files == 1
        keys = list(index.records)
        got = eng.read(keys)
        for k in keys:
            assert bytes(got[k][:8192]) == file_bytes(index, k)
        used = {(c[0], c[1]) for c in disk.calls}
        assert ("mirror0", "layer-001.bin") in used  # the mirror takes a share of what it holds
        assert not any(c[0] == "mirror0" and c[1] != "layer-001.bin" for c in disk.calls)


def test_mirror_of_another_model_is_refused(tmp_path: Path, index: ExpertIndex) -> None:
    m = tmp_path / "other"
    shutil.copytree(index.root, m)
    doc = json.loads((m / "index.json").read_text())
    doc["identity"] = "0123456789abcdef"
    (m / "index.json").write_text(json.dumps(doc))
    with IOEngine(index, depth=1, mirrors=[m]) as eng:
        d = eng.stats().disks[1]
        assert d.state == "degraded" and d.files == 0
        assert eng.copies.order((1, 0), index.records[(1, 0)])[0].name == "primary"


def test_placement_is_deterministic_and_weighted(tmp_path: Path, index: ExpertIndex) -> None:
    shutil.copytree(index.root, tmp_path / "m")
    picks = []
    for _ in range(2):
        with IOEngine(index, depth=1, mirrors=[tmp_path / "m"], mirror_weights=[1.0, 3.0]) as eng:
            picks.append([eng.copies.order(k, loc)[0].name for k, loc in index.records.items()])
    assert picks[0] == picks[1]
    share = Counter(picks[0])["mirror0"] / len(picks[0])
    assert 0.6 < share < 0.9  # ~3/4 of the 48 records
    with IOEngine(index, depth=2, mirrors=[tmp_path / "m"]) as eng:  # weights probed at start-up
        disks = eng.stats().disks
        assert all(d.weight > 0 for d in disks) and disks[0].weight != 1.0


def test_removing_a_mirror_while_reading_fails_no_read(tmp_path: Path, index: ExpertIndex) -> None:
    m = tmp_path / "mirror"
    shutil.copytree(index.root, m)
    keys = list(index.records)
    errors: list[BaseException] = []
    reads = Counter[str]()
    stop = threading.Event()
    with IOEngine(index, depth=4, mirrors=[m], mirror_weights=[1.0, 1.0], reprobe_interval_s=0.05) as eng:
        disk = Disk(eng)

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                batch = rng.sample(keys, 4)
                try:
                    got = eng.read(batch)
                    for k in batch:
                        assert bytes(got[k][:8192]) == file_bytes(index, k)
                    reads["ok"] += 1
                except BaseException as e:
                    errors.append(e)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.15)
        shutil.rmtree(m)
        time.sleep(0.3)
        s = eng.stats()
        assert s.disks[1].state == "degraded" and s.disks[1].degraded_total >= 1
        mirror_reads_when_gone = s.disks[1].reads
        time.sleep(0.1)
        assert eng.stats().disks[1].reads == mirror_reads_when_gone  # nothing served by the gone mirror
        # the mirror comes back: the periodic re-check brings it back into service
        shutil.copytree(index.root, m)
        deadline = time.monotonic() + 5
        while eng.stats().disks[1].state != "ok" and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
        s = eng.stats()
    assert not errors, errors[:3]
    assert reads["ok"] > 10
    assert s.disks[1].state == "ok" and s.disks[1].recovered_total >= 1
    assert s.disks[1].reads > mirror_reads_when_gone
    assert any(c[0] == "mirror0" for c in disk.calls)


def test_read_error_on_mirror_falls_back_to_primary(tmp_path: Path, index: ExpertIndex) -> None:
    m = tmp_path / "mirror"
    shutil.copytree(index.root, m)
    with IOEngine(index, depth=1, mirrors=[m], mirror_weights=[1e-9, 1.0], reprobe_interval_s=60) as eng:
        (m / "layer-002.bin").unlink()  # removed while open: st_nlink drops to 0
        got = eng.read([(2, 5)])
        assert bytes(got[(2, 5)][:8192]) == file_bytes(index, (2, 5))
        s = eng.stats()
        assert s.disks[1].errors == 1 and s.disks[1].state == "degraded" and s.fallbacks == 1
        eng.read([(1, 5)])  # degraded: the primary serves everything until the re-check
        assert eng.stats().disks[1].reads == 0


def test_an_unreadable_mirror_directory_degrades_at_start_instead_of_failing_it(tmp_path: Path,
                                                                                index: ExpertIndex) -> None:
    """Found by `moetier chaos` (mirror-unreadable): a mirror directory of mode 000 made the store's
    start fail (PermissionError looking for its experts/ folder). Run in a process that obeys file
    permissions (as root: without the DAC capabilities)."""
    import os
    import subprocess
    import sys

    m = tmp_path / "mirror"
    shutil.copytree(index.root, m)
    m.chmod(0)
    prefix: list[str] = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: root reads a mode-000 directory anyway")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    script = (
        "import json, sys\n"
        "from moetier.store.io import IOEngine\n"
        "from moetier.weights.index import ExpertIndex\n"
        "index = ExpertIndex.load(sys.argv[1])\n"
        "with IOEngine(index, depth=2, mirrors=[sys.argv[2]], mirror_weights=[1.0, 1.0]) as eng:\n"
        "    got = eng.read(list(index.records))\n"
        "    d = eng.stats().disks[1]\n"
        "    print(json.dumps({'read': len(got), 'state': d.state, 'files': d.files}))\n")
    try:
        r = subprocess.run([*prefix, sys.executable, "-c", script, str(index.root), str(m)], capture_output=True,
                           text=True, timeout=120)
    finally:
        m.chmod(0o755)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"read": len(index.records), "state": "degraded",
                                                            "files": 0}
