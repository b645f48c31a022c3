"""Expert record layout: where gate, up and down (and their scales) sit inside a record.

A record is `gate.q, gate.scales, up.q, up.scales, down.q, down.scales` (f32/bf16 parts
have no scales; mxfp4 scales are e8m0 bytes), then, for experts with biases (gpt-oss),
`gate_bias, up_bias, down_bias` as float32 [1, I], [1, I], [1, D], each starting on a
64-byte boundary, zero-padded to a multiple of 4096 bytes. The expert's activation
(`ExpertAct`: SwiGLU, or gpt-oss's clamped variant with its alpha and limit) is part of
the layout too, so a record is computed the same wherever it is read. All records of a container share one layout, stored in experts/index.json.
`parse` returns zero-copy views into the caller's buffer, so a record read by the I/O
engine into an aligned buffer is usable as-is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moetier.errors import FormatError
from moetier.model.config import ModelArgs
from moetier.weights.format import PART_ALIGN, RECORD_ALIGN
from moetier.weights.quant import (
    MXFP4_GROUP,
    QDTYPES,
    SILU,
    ExpertAct,
    ExpertWeights,
    QDType,
    QTensor,
    quantized_nbytes,
)

PART_NAMES = ("gate", "up", "down")
BIAS_NAMES = ("gate_bias", "up_bias", "down_bias")
_DATA_DTYPE = {"f32": np.float32, "bf16": np.uint16, "int8": np.int8, "int4": np.uint8, "mxfp4": np.uint8}


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class PartLayout:
    name: str
    dtype: QDType
    shape: tuple[int, int]  # logical [R, C]
    group_size: int  # 0 for f32/bf16
    data_offset: int
    data_bytes: int
    scales_offset: int | None
    scales_bytes: int

    @property
    def end(self) -> int:
        if self.scales_offset is None:
            return self.data_offset + self.data_bytes
        return self.scales_offset + self.scales_bytes

    @property
    def stored_shape(self) -> tuple[int, int]:
        """Shape of the data array: [R, Cp] (int8), [R, Cp/2] (int4), [R, C] (f32/bf16)."""
        r, c = self.shape
        if self.dtype in ("f32", "bf16"):
            return (r, c)
        cp = _align(c, self.group_size)
        return (r, cp // 2) if self.dtype in ("int4", "mxfp4") else (r, cp)

    def view(self, buf: np.ndarray, base: int = 0) -> QTensor:
        """QTensor viewing this part in a uint8 buffer holding a record (or a spilled part) at `base`."""
        o = base + self.data_offset
        data = buf[o:o + self.data_bytes].view(_DATA_DTYPE[self.dtype]).reshape(self.stored_shape)
        if self.scales_offset is None:
            return QTensor(self.dtype, self.shape, data)
        s = base + self.scales_offset
        sdt = np.uint8 if self.dtype == "mxfp4" else np.float16
        scales = buf[s:s + self.scales_bytes].view(sdt).reshape(self.shape[0], -1)
        return QTensor(self.dtype, self.shape, data, scales, self.group_size)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "group_size": self.group_size,
                "data_offset": self.data_offset, "data_bytes": self.data_bytes,
                "scales_offset": self.scales_offset, "scales_bytes": self.scales_bytes}


@dataclass(frozen=True)
class RecordLayout:
    parts: tuple[PartLayout, PartLayout, PartLayout]  # gate, up, down
    record_bytes: int
    biases: tuple[PartLayout, ...] = ()  # gate_bias, up_bias, down_bias (f32 [1, n]) or none
    act: ExpertAct = SILU

    @classmethod
    def build(cls, moe_intermediate: int, hidden: int, dtype: QDType, group_size: int, *,
              biases: bool = False, act: ExpertAct = SILU) -> RecordLayout:
        if dtype not in QDTYPES:
            raise ValueError(f"unknown expert dtype {dtype!r}")
        if dtype == "mxfp4":
            group_size = MXFP4_GROUP
        shapes = {"gate": (moe_intermediate, hidden), "up": (moe_intermediate, hidden), "down": (hidden, moe_intermediate)}
        g = group_size if dtype in ("int8", "int4", "mxfp4") else 0
        pos = 0
        parts = []
        for name in PART_NAMES:
            shape = shapes[name]
            data, scales = quantized_nbytes(shape, dtype, group_size)
            d_off = _align(pos, PART_ALIGN)
            pos = d_off + data
            s_off: int | None = None
            if scales:
                s_off = _align(pos, PART_ALIGN)
                pos = s_off + scales
            parts.append(PartLayout(name, dtype, shape, g, d_off, data, s_off, scales))
        bias_parts = []
        if biases:
            for name, n in zip(BIAS_NAMES, (moe_intermediate, moe_intermediate, hidden), strict=True):
                d_off = _align(pos, PART_ALIGN)
                pos = d_off + 4 * n
                bias_parts.append(PartLayout(name, "f32", (1, n), 0, d_off, 4 * n, None, 0))
        return cls((parts[0], parts[1], parts[2]), _align(pos, RECORD_ALIGN), tuple(bias_parts), act)

    @property
    def used_bytes(self) -> int:
        return (self.biases or self.parts)[-1].end

    @property
    def part_names(self) -> tuple[str, ...]:
        """Every part a record holds: gate, up, down (and their biases)."""
        return PART_NAMES + tuple(p.name for p in self.biases)

    def part(self, name: str) -> PartLayout:
        for p in (*self.parts, *self.biases):
            if p.name == name:
                return p
        raise KeyError(f"the record layout has no part {name!r} (it has {', '.join(self.part_names)})")

    def parse(self, buffer: bytes | bytearray | memoryview | np.ndarray) -> ExpertWeights:
        """Zero-copy ExpertWeights over a buffer of at least `used_bytes` bytes."""
        buf = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
        buf = buf.reshape(-1).view(np.uint8)
        if buf.nbytes < self.used_bytes:
            raise FormatError(f"expert record buffer holds {buf.nbytes} bytes, the layout needs {self.used_bytes}")
        g, u, d = (p.view(buf) for p in self.parts)
        if not self.biases:
            return ExpertWeights(gate=g, up=u, down=d, act=self.act)
        gb, ub, db = (p.view(buf).data.reshape(-1) for p in self.biases)  # [I], [I], [D]
        return ExpertWeights(gate=g, up=u, down=d, gate_bias=gb, up_bias=ub, down_bias=db, act=self.act)

    def pack(self, ew: ExpertWeights) -> bytearray:
        """The record bytes of one expert (`record_bytes` long, zero padding)."""
        if ew.act != self.act:
            raise ValueError(f"expert activation {ew.act} differs from the layout's {self.act}")
        out = bytearray(self.record_bytes)
        for p, t in zip(self.parts, (ew.gate, ew.up, ew.down), strict=True):
            pack_part_into(p, t, out, 0)
        vecs = (ew.gate_bias, ew.up_bias, ew.down_bias)
        if bool(self.biases) != any(v is not None for v in vecs):
            raise ValueError(f"expert biases given: {[v is not None for v in vecs]}, the layout has "
                             f"{'them' if self.biases else 'none'}")
        for p, v in zip(self.biases, vecs, strict=False):
            if v is None:
                raise ValueError(f"expert {p.name} is missing")
            pack_part_into(p, bias_tensor(v), out, 0)
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"record_bytes": self.record_bytes, "parts": [p.to_dict() for p in self.parts]}
        if self.biases:  # layouts without them keep the index (and its identity) they had
            d["biases"] = [p.to_dict() for p in self.biases]
        if self.act != SILU:
            d["act"] = self.act.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecordLayout:
        def part(p: dict[str, Any]) -> PartLayout:
            return PartLayout(str(p["name"]), p["dtype"], (int(p["shape"][0]), int(p["shape"][1])), int(p["group_size"]),
                              int(p["data_offset"]), int(p["data_bytes"]),
                              None if p["scales_offset"] is None else int(p["scales_offset"]), int(p["scales_bytes"]))

        try:
            parts = tuple(part(p) for p in d["parts"])
            biases = tuple(part(p) for p in d.get("biases", ()))
            a = d.get("act")
            act = SILU if a is None else ExpertAct(a["kind"], float(a["alpha"]), float(a["limit"]))
            if act.kind not in ("silu", "clamped_swiglu"):
                raise ValueError(f"unknown expert activation {act.kind!r}")
            lay = cls((parts[0], parts[1], parts[2]), int(d["record_bytes"]), biases, act)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise FormatError(f"experts/index.json: malformed record layout ({e!r})") from e
        if len(parts) != 3 or tuple(p.name for p in parts) != PART_NAMES:
            raise FormatError("experts/index.json: layout parts must be gate, up, down")
        g = lay.parts[0]
        try:
            want = cls.build(g.shape[0], g.shape[1], g.dtype, g.group_size or 64, biases=bool(biases), act=act)
        except (ValueError, ZeroDivisionError) as e:
            raise FormatError(f"experts/index.json: record layout {g.dtype!r} [{g.shape[0]}, {g.shape[1]}] "
                              f"g={g.group_size}: {e}"[:300]) from e
        if want != lay:
            raise FormatError("experts/index.json: record layout is not the canonical layout for "
                              f"{g.dtype} [{g.shape[0]}, {g.shape[1]}] g={g.group_size}")
        return lay


def pack_part_into(p: PartLayout, t: QTensor, out: bytearray | memoryview, base: int) -> None:
    """Copy one QTensor into `out` at `base` following part layout `p` (checks dtype and shape)."""
    if t.dtype != p.dtype or tuple(t.shape) != p.shape or (p.group_size and t.group_size != p.group_size):
        raise ValueError(f"expert {p.name}: got {t.dtype}{list(t.shape)} g={t.group_size}, "
                         f"layout wants {p.dtype}{list(p.shape)} g={p.group_size}")
    data = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
    if data.nbytes != p.data_bytes:
        raise ValueError(f"expert {p.name}: data is {data.nbytes} bytes, layout wants {p.data_bytes}")
    o = base + p.data_offset
    out[o:o + p.data_bytes] = data.tobytes()
    if p.scales_offset is not None:
        assert t.scales is not None
        sdt = np.uint8 if p.dtype == "mxfp4" else np.float16
        sc = np.ascontiguousarray(t.scales, dtype=sdt).view(np.uint8).reshape(-1)
        s = base + p.scales_offset
        out[s:s + p.scales_bytes] = sc.tobytes()


def bias_tensor(v: np.ndarray) -> QTensor:
    """A bias vector [n] as the f32 [1, n] part it is stored as."""
    a = np.ascontiguousarray(v, dtype=np.float32).reshape(1, -1)
    return QTensor("f32", (1, a.shape[1]), a)


def model_layout(args: ModelArgs, dtype: QDType, group_size: int) -> RecordLayout:
    """The record layout of `args`'s routed experts: with biases and gpt-oss's clamped SwiGLU
    where the model has them."""
    act = (ExpertAct("clamped_swiglu", args.swiglu_alpha, args.swiglu_limit) if args.expert_act == "clamped_swiglu"
           else SILU)
    return RecordLayout.build(args.moe_intermediate_size, args.hidden_size, dtype, group_size,
                              biases=args.expert_bias, act=act)
