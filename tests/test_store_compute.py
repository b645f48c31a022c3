"""One expert path: the one index reader (moetier/weights/index.py) and the one tier-compute loop
(moetier/store/compute.py) that the in-process engine and the expert store both run."""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers_store import Disk, wait_for

from moetier.convert import synth
from moetier.errors import DataCorruption, FormatError
from moetier.kernels.fast import FastOps
from moetier.model.ops import ReferenceOps
from moetier.settings import load_settings
from moetier.store.compute import TierCompute
from moetier.store.provider import TieredExperts
from moetier.store.synth import f32_parser, f32_record, write_records
from moetier.store.tier import ExpertTier, TierConfig
from moetier.weights.container import Container
from moetier.weights.index import ExpertIndex, index_identity
from moetier.weights.quant import ExpertWeights

ROOT = Path(__file__).resolve().parents[1]
D, INTER = 32, 16  # hidden, expert intermediate of the f32 record set
REC = 3 * D * INTER * 4  # 6 KiB of float32, padded to 8 KiB


def f32_set(tmp: Path) -> ExpertIndex:
    return write_records(tmp / "model", (1, 2), 8, REC, fill=lambda _k, rng: f32_record(D, INTER, rng),
                         parse=f32_parser(D, INTER))


# ---- the index --------------------------------------------------------------------------------
def test_a_written_record_set_reads_back_through_the_one_reader(tmp_path: Path) -> None:
    written = write_records(tmp_path / "m", (1, 3), 4, 5000)
    read = ExpertIndex.load(tmp_path / "m")  # a container-style directory: its experts/ is found
    assert read.records == written.records and read.identity == written.identity
    assert (read.layers, read.n_experts, read.files, read.record_bytes) == ((1, 3), 4, written.files, 8192)
    assert read.layout is None and read.parse is None  # a bare set: raw record buffers


def _tampered(tmp_path: Path, edit: Any, keep_identity: bool = False) -> Path:
    write_records(tmp_path / "m", (1, 2), 4, 4096)
    path = tmp_path / "m" / "experts" / "index.json"
    doc = json.loads(path.read_text())
    edit(doc)
    if not keep_identity:
        doc["identity"] = index_identity(doc["layout"], doc["files"], doc["records"])
    path.write_text(json.dumps(doc))
    return tmp_path / "m" / "experts"


@pytest.mark.parametrize(("edit", "keep", "match"), [
    (lambda d: d["records"].append(list(d["records"][0])), False, r"record layer 1 expert 0 .*: duplicate"),
    (lambda d: d["records"].pop(), False, r"7 records, the index names 2 MoE layers x 4 experts = 8"),
    (lambda d: d["records"][1].__setitem__(3, 100), False, r"record layer 1 expert 1 .* not 4096-aligned"),
    (lambda d: d["records"][3].__setitem__(3, 1 << 20), False, r"record layer 1 expert 3 .* past the end"),
    (lambda d: d["records"][2].__setitem__(5, "0" * 16), True, r"identity does not match"),
    (lambda d: d["records"][2].__setitem__(1, 9), False, r"record layer 1 expert 9 .* no such MoE layer/expert"),
    (lambda d: d["files"].__setitem__(0, "../layer-001.bin"), False, r"files must be .* inside the experts"),
    (lambda d: d.update(format_version=2), False, r"format_version 2, this moetier reads 1"),
    (lambda d: d.update(extra=1), False, r"unknown field\(s\) extra"),
    (lambda d: d["records"][0].__setitem__(5, "not hex"), False, r"malformed record"),
])
def test_a_bad_index_is_refused_naming_what_is_wrong(tmp_path: Path, edit: Any, keep: bool, match: str) -> None:
    experts = _tampered(tmp_path, edit, keep)
    with pytest.raises(FormatError, match=match) as info:
        ExpertIndex.load(experts)
    assert str(experts / "index.json") in str(info.value)


def test_the_container_and_the_tier_share_one_index(tmp_path: Path) -> None:
    with Container.open(synth.write_container("tiny-deepseek_v3", tmp_path / "tiny", 0)) as c:
        assert c.index.layout == c.layout and c.index.parse is not None
        with TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=c.expert_bytes), depth=1) as experts:
            assert experts.tier.index is c.index  # no second index, no conversion
            layer = c.args.moe_layer_ids[0]
            with experts.tier.acquire(layer, [3]) as ex:
                np.testing.assert_array_equal(ex[3].up.dequantize(), c.read_expert(layer, 3).up.dequantize())


# ---- the tier-compute loop ----------------------------------------------------------------------
class RecordingOps(FastOps):
    """FastOps that notes which experts each `expert_outputs` call computed."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.calls: list[list[int]] = []

    def expert_outputs(self, x: Any, ids: Any, experts: Mapping[int, ExpertWeights], out: Any) -> None:
        self.calls.append(sorted(experts))
        super().expert_outputs(x, ids, experts, out)


def test_resident_experts_compute_while_the_missing_ones_are_read(tmp_path: Path) -> None:
    index = f32_set(tmp_path)
    ops = RecordingOps()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, D), dtype=np.float32)
    ids = np.array([[0, 5], [1, 0], [5, 6]], dtype=np.int32)
    w = rng.random((3, 2), dtype=np.float32)
    with ExpertTier.open(index, TierConfig(budget_bytes=8 * 8192), depth=2) as tier:
        compute = TierCompute(tier, ops)
        with tier.acquire(1, [0, 1]) as everything_but:  # 0 and 1 resident; 5 and 6 on disk
            assert sorted(everything_but) == [0, 1]
        disk = Disk(tier.engine, hold=True)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("r", compute.run(1, x, ids, w)))
        t.start()
        disk.wait_active(2)  # both reads held at the gate...
        wait_for(lambda: ops.calls == [[0, 1]])  # ...while the resident experts are computed
        assert disk.active == 2 and "r" not in out
        disk.gate.set()
        t.join(10)
        r = out["r"]
        assert sorted(e for call in ops.calls for e in call) == [0, 1, 5, 6]  # each computed once
        assert (r.hits, r.misses, r.waves) == (2, 2, 1)
        with tier.acquire(1, ids) as experts:
            np.testing.assert_array_equal(r.output, FastOps(threads=1).moe(x, ids, w, experts))
        totals = compute.totals()
        assert (totals.calls, totals.rows, totals.hits, totals.misses) == (1, 3, 2, 2)


def test_a_failed_read_fails_the_call_and_leaves_nothing_pinned(tmp_path: Path) -> None:
    index = f32_set(tmp_path)
    with ExpertTier.open(index, TierConfig(budget_bytes=8 * 8192), depth=2) as tier:
        compute = TierCompute(tier, ReferenceOps())
        loc = index.records[(2, 4)]
        with open(index.root / loc.path, "r+b") as f:  # one bit of one record flipped
            f.seek(loc.offset + 10)
            b = f.read(1)
            f.seek(loc.offset + 10)
            f.write(bytes([b[0] ^ 1]))
        x = np.ones((2, D), dtype=np.float32)
        with pytest.raises(DataCorruption, match="layer 2 expert 4"):
            compute.run(2, x, np.array([[3, 4], [4, 3]], dtype=np.int32), np.ones((2, 2), dtype=np.float32))
        s = tier.stats()
        assert s.pinned_experts == 0 and s.loading_experts == 0
        tier.check_invariants()


def test_the_store_and_the_engine_run_one_loop_with_one_accounting(tmp_path: Path) -> None:
    """Same calls, same budget, both fresh: the store's core and the in-process provider return
    the same bits and count the same hits, misses and waves (a union over the budget in waves)."""
    import asyncio

    from services.expert_store.core import ComputeBatch, StoreCore

    model = synth.write_container("tiny-deepseek_v3", tmp_path / "tiny", 0)
    rec = 8192
    settings = load_settings(overrides={"model": {"path": str(model), "expert_cache": str(3 * rec)},
                                        "cache": {"policy": "lru"}, "data_dir": str(tmp_path / "data")},
                             environ={})
    rng = np.random.default_rng(3)
    calls = [(1, rng.integers(0, 8, (n, 2)).astype(np.int32)) for n in (1, 4, 12)] + [(2, np.array([[1, 2]]))]
    core = StoreCore(settings, threads=1)
    with Container.open(model) as c:
        engine = TieredExperts.open(c, FastOps(threads=1), TierConfig(budget_bytes=3 * rec, policy="lru"))
        try:
            assert isinstance(core.experts, TierCompute) and isinstance(engine.compute, TierCompute)
            for layer, ids in calls:
                x = rng.standard_normal((ids.shape[0], 64), dtype=np.float32)
                w = rng.random(ids.shape, dtype=np.float32)
                a = asyncio.run(core.compute(ComputeBatch(layer, x, ids.astype(np.int32), w)))
                b = engine.compute.run(layer, x, ids.astype(np.int32), w)
                np.testing.assert_array_equal(a.output, b.output)
                assert (a.hits, a.misses, a.waves) == (b.hits, b.misses, b.waves)
            assert engine.compute.totals().waves > len(calls)  # some unions were over the budget
        finally:
            engine.close()
            core.close()


def test_a_roomy_tier_runs_whole_moe_layers_in_one_call(tmp_path: Path) -> None:
    """TieredExperts.resident_table: where the tier never evicts and holds every expert of a layer,
    MoeBlock.block runs the layer in one kernel call (FastOps.moe_block) with the logits of the
    tier's own loop, and the calls are counted as the loop counts them (calls, rows, hits, the
    tier's hits). A tier that may evict makes no table; nor does one still missing an expert."""
    from moetier.engine import load_dense
    from moetier.model.forward import Model

    model = synth.write_container("tiny-qwen3_moe", tmp_path / "tiny", 0)
    rng = np.random.default_rng(4)
    with Container.open(model) as c:
        args, dense = c.args, load_dense(c)
        ids = rng.integers(0, args.vocab_size, 12)
        ops = FastOps(threads=2)
        fused = {"n": 0}
        real = ops.moe_block

        def counted(*a: Any) -> Any:
            fused["n"] += 1
            return real(*a)

        ops.moe_block = counted  # type: ignore[method-assign]
        runs = []
        for roomy in (True, False):
            budget = c.index.total_bytes if roomy else c.index.total_bytes - 1
            with TieredExperts.open(c, ops, TierConfig(budget_bytes=budget, policy="lru")) as ex:
                layer = args.moe_layer_ids[0]
                assert ex.resident_table(layer, ops, args.n_routed_experts) is None  # nothing read yet
                ex.tier.preload()
                m = Model(args, dense, ops, ex)
                cache = m.new_cache()
                logits = [m.step([(cache, ids[:6])])[0]] + [m.step([(cache, ids[i : i + 1])])[0] for i in range(6, 12)]
                runs.append(np.stack(logits))
                tables = [ex.resident_table(n, ops, args.n_routed_experts) for n in args.moe_layer_ids]
                assert all(t is not None for t in tables) == roomy
                assert ex.resident_table(layer, FastOps(threads=1), args.n_routed_experts) is None  # other kernels
                totals, tier = ex.stats(), ex.tier.stats()
                assert totals.calls == 7 * len(args.moe_layer_ids) and totals.rows == 12 * len(args.moe_layer_ids)
                if roomy:  # every expert read at preload: each call's union a hit, in both counts
                    assert totals.misses == 0 and totals.hits == sum(tier.hits.values()) > 0
            assert fused["n"] == (7 * len(args.moe_layer_ids) if roomy else 0)
            fused["n"] = 0
        np.testing.assert_array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))


# ---- the benchmark's view ----------------------------------------------------------------------
def test_the_library_never_imports_a_service() -> None:
    """Services import the library, never the reverse (moetier/commands only to run one)."""
    for path in sorted((ROOT / "moetier").rglob("*.py")):
        if path.parent.name == "commands":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "services" or n.startswith("services.") for n in names), path


def test_the_engine_starts_a_layer_with_misses_on_a_helper_and_returns_at_once(tmp_path: Path) -> None:
    """TieredExperts.moe_start: resident experts computed here (nothing to wait for); with a read
    to wait for, the loop runs on a helper while the caller goes on (its shared expert), and the
    result is `moe`'s bits."""
    index = f32_set(tmp_path)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, D), dtype=np.float32)
    ids = np.array([[1, 2], [2, 3]], dtype=np.int32)
    w = rng.random((2, 2), dtype=np.float32)
    ops = FastOps(threads=1)
    with TieredExperts(None, ops, ExpertTier.open(index, TierConfig(budget_bytes=8 * 8192), depth=2)) as experts, \
            TieredExperts(None, ops, ExpertTier.open(index, TierConfig(budget_bytes=8 * 8192), depth=2)) as ref:
        want = ref.moe(1, x, ids, w)
        disk = Disk(experts.tier.engine, hold=True)
        call = experts.moe_start(1, x, ids, w)  # returns with the reads held at the gate
        disk.wait_active(2)  # the I/O engine's depth
        disk.gate.set()
        np.testing.assert_array_equal(call.result(), want)
        resident = experts.moe_start(1, x, ids, w)  # everything resident now: computed at once
        assert disk.reads() == 3
        np.testing.assert_array_equal(resident.result(), want)
