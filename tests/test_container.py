"""Container writer/reader: round trips for every dtype, loud validation, corrupted inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moetier.errors import DataCorruption, FormatError
from moetier.model.config import ModelArgs
from moetier.weights import Container, ContainerWriter
from moetier.weights.format import MANIFEST, RECORD_ALIGN
from moetier.weights.quant import ExpertWeights, QDType, quantize
from moetier.weights.schema import dense_shapes, expert_shapes

ARGS = ModelArgs(arch="test", vocab_size=100, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96, moe_layers=(False, True, True), n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=48, qkv_bias=True, qk_norm="head")


def _expert(li: int, e: int, dtype: QDType) -> ExpertWeights:
    rng = np.random.default_rng([li, e])
    sh = expert_shapes(ARGS)
    return ExpertWeights(*(quantize(rng.standard_normal(sh[p]).astype(np.float32), dtype, 64)
                           for p in ("gate", "up", "down")))


def build(out: Path, experts: QDType = "int4", dense: QDType = "int8", order: int = 1) -> Path:
    w = ContainerWriter(out, ARGS, experts, dense, 64)
    names = list(w.dense_specs)
    half = len(names) // 2
    rng = np.random.default_rng(0)
    for k, group in ((1, names[:half]), (2, names[half:])):
        f = w.dense_file(k, group)
        for n in group:
            s = w.dense_specs[n]
            f.add(n, quantize(rng.standard_normal(s.shape).astype(np.float32), s.dtype, 64))
        f.close()
    keys = [(li, e) for li in ARGS.moe_layer_ids for e in range(4)][::order]
    for li, e in keys:
        w.write_record(li, e, _expert(li, e, experts))
    w.finish({"kind": "test"}, {"config.json": b"{}\n"})
    return out


@pytest.mark.parametrize("experts", ["int4", "int8", "bf16", "f32"])
@pytest.mark.parametrize("dense", ["int8", "bf16", "f32"])
def test_round_trip(tmp_path: Path, experts: QDType, dense: QDType) -> None:
    c = Container.open(build(tmp_path / "c", experts, dense), verify=True)
    assert c.args == ARGS
    assert c.quantization == {"experts": experts, "dense": dense, "group_size": 64}
    assert c.dense("layers.0.attn.bq").dtype == "f32"  # exact class stays f32
    assert c.dense("layers.0.attn.wq").dtype == dense
    assert c.dense("layers.1.moe.router").dtype == "f32"
    q = c.dense("embed")
    assert isinstance(q.data, np.memmap) or isinstance(q.data.base, np.memmap)  # zero-copy view
    for li in ARGS.moe_layer_ids:
        for e in range(4):
            got, want = c.read_expert(li, e), _expert(li, e, experts)
            for a, b in zip((got.gate, got.up, got.down), (want.gate, want.up, want.down), strict=True):
                assert np.array_equal(a.dequantize(), b.dequantize())
            loc = c.index.location((li, e))
            assert loc.offset % RECORD_ALIGN == 0 and loc.length == c.layout.record_bytes
    assert c.expert_bytes == 8 * c.layout.record_bytes
    assert c.dense_names() == list(dense_shapes(ARGS))
    c.close()


def test_record_order_does_not_change_bytes(tmp_path: Path) -> None:
    a, b = build(tmp_path / "a"), build(tmp_path / "b", order=-1)
    for p in sorted(a.rglob("*")):
        if p.is_file():
            assert p.read_bytes() == (b / p.relative_to(a)).read_bytes(), p


def test_writer_enforces_completeness_and_order(tmp_path: Path) -> None:
    w = ContainerWriter(tmp_path / "c", ARGS)
    with pytest.raises(FormatError, match="missing dense tensors"):
        w.finish({}, {})
    assert not (tmp_path / "c" / MANIFEST).exists()
    full = build(tmp_path / "full")
    with pytest.raises(FormatError, match="already holds a complete container"):
        ContainerWriter(full, ARGS)
    w2 = ContainerWriter(tmp_path / "d", ARGS)
    with pytest.raises(FormatError, match="not a dense tensor"):
        w2.dense_file(1, ["layers.0.moe.router"])
    with pytest.raises(FormatError, match="not a MoE layer"):
        w2.write_record(0, 0, _expert(0, 0, "int4"))


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    return build(tmp_path / "c")


def test_flipped_byte_names_layer_expert_file_offset(good: Path) -> None:
    c = Container.open(good)
    loc = c.index.location((2, 3))
    c.close()
    path = good / "experts" / loc.path
    data = bytearray(path.read_bytes())
    data[loc.offset + 100] ^= 0x40
    path.write_bytes(bytes(data))
    c = Container.open(good)  # sizes still fine: opening works, reading the record does not
    with pytest.raises(DataCorruption) as ei:
        c.read_expert(2, 3)
    msg = str(ei.value)
    assert "layer 2 expert 3" in msg and f"experts/{loc.path}" in msg and f"offset {loc.offset}" in msg
    c.read_expert(2, 2)  # neighbours are fine
    with pytest.raises(DataCorruption, match="layer 2 expert 3"):
        Container.open(good, verify=True)


def test_truncated_expert_file(good: Path) -> None:
    p = good / "experts" / "layer-002.bin"
    p.write_bytes(p.read_bytes()[:-4096])
    with pytest.raises(FormatError, match=r"experts/layer-002\.bin: .* bytes, moetier\.json says"):
        Container.open(good)


def test_truncated_dense_file(good: Path) -> None:
    p = good / "dense" / "model-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(FormatError, match=r"dense/model-00002\.safetensors"):
        Container.open(good)


def test_missing_file(good: Path) -> None:
    (good / "config.json").unlink()
    with pytest.raises(FormatError, match=r"config\.json: listed in moetier\.json but missing"):
        Container.open(good)


def _edit_manifest(good: Path, fn: object) -> None:
    m = json.loads((good / MANIFEST).read_text())
    fn(m)  # type: ignore[operator]
    (good / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("expert_bytes"), "missing field.*expert_bytes"),
    (lambda m: m.update(surprise=1), "unknown field.*surprise"),
    (lambda m: m.update(format_version=2), "format_version 2 unsupported"),
    (lambda m: m.update(format="other"), "format 'other'"),
    (lambda m: m["model"].update(bogus=1), "unknown ModelArgs fields"),
    (lambda m: m["model"].update(moe_intermediate_size=64), "record layout does not match"),
    (lambda m: m["quantization"].update(experts="int3"), "unsupported quantization"),
    (lambda m: m["files"].update({"../etc/passwd": {"size": 1, "xxh3_64": "0"}}), "outside the container"),
    (lambda m: m.update(expert_bytes=1), "expert_bytes"),
])
def test_bad_manifest(good: Path, edit: object, match: str) -> None:
    _edit_manifest(good, edit)
    with pytest.raises(FormatError, match=match):
        Container.open(good)


def test_bad_index_and_unfinished(good: Path, tmp_path: Path) -> None:
    idx = good / "experts" / "index.json"
    d = json.loads(idx.read_text())
    d["records"][0][5] = "0" * 16
    idx.write_text(json.dumps(d))
    size = idx.stat().st_size
    _edit_manifest(good, lambda m: m["files"]["experts/index.json"].update(size=size))
    with pytest.raises(FormatError, match="identity"):
        Container.open(good)
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / MANIFEST).unlink()
    with pytest.raises(FormatError, match=r"no moetier\.json"):
        Container.open(partial)


def test_dense_metadata_must_match(good: Path) -> None:
    # a manifest claiming int8 dense while the file says otherwise is refused, naming file and tensor
    _edit_manifest(good, lambda m: m["quantization"].update(dense="bf16"))
    with pytest.raises(FormatError, match=r"dense/model-0000\d\.safetensors: tensor '.*' is int8"):
        Container.open(good)
