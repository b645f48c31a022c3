"""Quantization and record layout round trips for every dtype."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.errors import FormatError
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import QDTYPES, ExpertAct, ExpertWeights, dequantize, quantize, relative_rms_error
from moetier.weights.schema import tensor_class

BOUND = {"f32": 0.0, "bf16": 0.005, "int8": 0.01, "int4": 0.15, "mxfp4": 0.2}


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("cols", [64, 96, 37 * 2])
def test_quantize_round_trip(dtype: str, cols: int) -> None:
    x = np.random.default_rng(1).standard_normal((16, cols)).astype(np.float32)
    q = quantize(x, dtype, 64)  # type: ignore[arg-type]
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == np.float32
    assert relative_rms_error(x, y) <= BOUND[dtype]
    # quantizing the dequantized values again is exact (the scales are what they decided)
    if dtype in ("int8", "int4", "mxfp4"):
        assert np.array_equal(dequantize(quantize(y, dtype, 64)), y)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("inter,hidden", [(32, 64), (48, 64), (64, 128)])
def test_record_layout_pack_parse(dtype: str, inter: int, hidden: int) -> None:
    lay = RecordLayout.build(inter, hidden, dtype, 64)  # type: ignore[arg-type]
    assert lay.record_bytes % 4096 == 0 and lay.used_bytes <= lay.record_bytes
    for p in lay.parts:
        assert p.data_offset % 64 == 0 and (p.scales_offset is None or p.scales_offset % 64 == 0)
        assert (p.scales_offset is None) == (dtype in ("f32", "bf16"))
    rng = np.random.default_rng(2)
    ew = ExpertWeights(*(quantize(rng.standard_normal(s).astype(np.float32), dtype, 64)  # type: ignore[arg-type]
                         for s in [(inter, hidden), (inter, hidden), (hidden, inter)]))
    rec = lay.pack(ew)
    assert len(rec) == lay.record_bytes and not any(rec[lay.used_bytes:])
    back = lay.parse(rec)
    for a, b in zip((ew.gate, ew.up, ew.down), (back.gate, back.up, back.down), strict=True):
        assert np.array_equal(dequantize(a), dequantize(b))
    # zero-copy: views of the buffer, not copies
    buf = np.frombuffer(bytes(rec), dtype=np.uint8)
    assert np.shares_memory(lay.parse(buf).down.data, buf)
    assert RecordLayout.from_dict(lay.to_dict()) == lay


def test_layout_rejects_wrong_parts_and_short_buffers() -> None:
    lay = RecordLayout.build(32, 64, "int4", 64)
    wrong = ExpertWeights(*(quantize(np.ones(s, np.float32), "int8") for s in [(32, 64), (32, 64), (64, 32)]))
    with pytest.raises(ValueError, match="gate"):
        lay.pack(wrong)
    with pytest.raises(FormatError, match="needs"):
        lay.parse(bytes(100))
    d = lay.to_dict()
    d["parts"][1]["data_offset"] += 64
    with pytest.raises(FormatError, match="canonical layout"):
        RecordLayout.from_dict(d)


def test_tensor_classes() -> None:
    assert tensor_class("layers.0.attn_norm", (64,)) == "exact"
    assert tensor_class("layers.3.moe.router", (8, 64)) == "exact"
    assert tensor_class("layers.3.moe.shared_gate", (1, 64)) == "exact"
    assert tensor_class("layers.3.attn.bq", (64,)) == "exact"
    assert tensor_class("layers.3.attn.wq_a", (32, 64)) == "dense"
    assert tensor_class("embed", (512, 64)) == "dense"
    assert tensor_class("lm_head", (512, 64)) == "dense"


def test_record_layout_with_biases_and_the_clamped_activation() -> None:
    """gpt-oss records: mxfp4 matrices, float32 biases after them, the activation in the layout
    (and in its dict, so the index says how a record is computed); plain layouts' dicts unchanged."""
    act = ExpertAct("clamped_swiglu", 1.702, 7.0)
    lay = RecordLayout.build(32, 64, "mxfp4", 64, biases=True, act=act)
    plain = RecordLayout.build(32, 64, "mxfp4", 64)
    assert [p.name for p in lay.biases] == ["gate_bias", "up_bias", "down_bias"]
    assert lay.used_bytes == lay.biases[-1].end > plain.used_bytes
    assert "biases" not in plain.to_dict() and "act" not in plain.to_dict()
    assert RecordLayout.from_dict(lay.to_dict()) == lay
    rng = np.random.default_rng(4)
    mats = [quantize(rng.standard_normal(s).astype(np.float32), "mxfp4") for s in ((32, 64), (32, 64), (64, 32))]
    vecs = [rng.standard_normal(n).astype(np.float32) for n in (32, 32, 64)]
    ew = ExpertWeights(*mats, *vecs, act=act)  # type: ignore[misc]
    back = lay.parse(lay.pack(ew))
    assert back.act == act
    for a, b in zip((back.gate_bias, back.up_bias, back.down_bias), vecs, strict=True):
        assert a is not None and np.array_equal(a, b)
    for a, b in zip((back.gate, back.up, back.down), mats, strict=True):
        assert np.array_equal(a.data, b.data) and np.array_equal(a.scales, b.scales)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="biases"):
        lay.pack(ExpertWeights(*mats, act=act))
    with pytest.raises(ValueError, match="activation"):
        lay.pack(ExpertWeights(*mats, *vecs))  # type: ignore[misc]
