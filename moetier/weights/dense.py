"""Dense tensors in safetensors files (docs/internals.md, 'Dense tensors').

For a canonical name N: f32 -> `N` F32; bf16 -> `N` U16; int8 -> `N.q` I8 [R, Cp] and
`N.scales` F16 [R, Cp/g]; int4 -> `N.q` U8 [R, Cp/2] and `N.scales` F16. The header's
`__metadata__["moetier"]` is JSON {N: {"dtype", "shape", "group_size"}} for every tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetier.errors import FormatError
from moetier.weights.format import SAFETENSORS_META_KEY
from moetier.weights.quant import QDTYPES, QDType, QTensor
from moetier.weights.safetensors_io import MappedFile, SafetensorsWriter


@dataclass(frozen=True)
class DenseSpec:
    name: str
    dtype: QDType
    shape: tuple[int, ...]
    group_size: int  # 0 for f32/bf16

    @property
    def padded_cols(self) -> int:
        c = self.shape[-1]
        return c if not self.group_size else -(-c // self.group_size) * self.group_size

    def entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        n = self.name
        if self.dtype == "f32":
            return [(n, "F32", self.shape)]
        if self.dtype == "bf16":
            return [(n, "U16", self.shape)]
        r, cp = self.shape[0], self.padded_cols
        q = (n + ".q", "I8", (r, cp)) if self.dtype == "int8" else (n + ".q", "U8", (r, cp // 2))
        return [q, (n + ".scales", "F16", (r, cp // self.group_size))]

    def meta(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "group_size": self.group_size}


def spec_of(name: str, t: QTensor) -> DenseSpec:
    return DenseSpec(name, t.dtype, tuple(t.shape), t.group_size if t.dtype in ("int8", "int4") else 0)


class DenseFileWriter:
    """One dense safetensors file: tensors declared up front, then added once each."""

    def __init__(self, path: Path, specs: Iterable[DenseSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        meta = {SAFETENSORS_META_KEY: json.dumps({n: s.meta() for n, s in self.specs.items()},
                                                 separators=(",", ":"))}
        self._w = SafetensorsWriter(path, [e for s in self.specs.values() for e in s.entries()], meta)
        self.path = path

    def add(self, name: str, t: QTensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise RuntimeError(f"{self.path}: tensor {name!r} was not declared")
        if spec_of(name, t) != spec:
            raise RuntimeError(f"{self.path}: tensor {name!r} is {spec_of(name, t)}, declared {spec}")
        if t.dtype in ("f32", "bf16"):
            self._w.write(name, t.data)
        else:
            assert t.scales is not None
            self._w.write(name + ".q", t.data)
            self._w.write(name + ".scales", t.scales)

    def close(self) -> None:
        self._w.close()

    def abort(self) -> None:
        self._w.abort()


class DenseFile:
    """A dense file opened with np.memmap; `get` returns QTensors viewing the map."""

    def __init__(self, path: Path, label: str) -> None:
        self.label = label
        self._mf = MappedFile(path, label)
        raw = self._mf.header.metadata.get(SAFETENSORS_META_KEY)
        if raw is None:
            raise FormatError(f"{label}: safetensors metadata has no {SAFETENSORS_META_KEY!r} key")
        try:
            meta = json.loads(raw)
            self.specs = {
                n: DenseSpec(n, m["dtype"], tuple(int(x) for x in m["shape"]), int(m["group_size"]))
                for n, m in meta.items()
            }
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OverflowError) as e:
            raise FormatError(f"{label}: malformed {SAFETENSORS_META_KEY!r} metadata ({e!r})"[:300]) from e
        have = self._mf.header.tensors
        want: set[str] = set()
        for s in self.specs.values():
            if not isinstance(s.dtype, str) or s.dtype not in QDTYPES:
                raise FormatError(f"{label}: tensor {s.name!r} has unknown dtype {s.dtype!r}"[:300])
            quantized = s.dtype in ("int8", "int4")
            if (any(x < 0 for x in s.shape) or (quantized and (len(s.shape) != 2 or s.group_size <= 0
                                                                or s.group_size % 2))
                    or (not quantized and s.group_size != 0)):
                raise FormatError(f"{label}: tensor {s.name!r}: {s.dtype} {list(s.shape)} with group size "
                                  f"{s.group_size} is not a valid dense tensor")
            for key, tag, shape in s.entries():
                want.add(key)
                t = have.get(key)
                if t is None:
                    raise FormatError(f"{label}: tensor {s.name!r} is missing its entry {key!r}")
                if t.dtype != tag or t.shape != shape:
                    raise FormatError(f"{label}: entry {key!r} is {t.dtype}{list(t.shape)} at offset {t.begin}, "
                                      f"expected {tag}{list(shape)}")
        extra = sorted(set(have) - want)
        if extra:
            raise FormatError(f"{label}: entry {extra[0]!r} is not described by the metadata")

    def get(self, name: str, data: np.ndarray | None = None) -> QTensor:
        """A tensor viewing the map (or `data`, the file's bytes from `read_resident`)."""
        s = self.specs[name]
        if s.dtype in ("f32", "bf16"):
            return QTensor(s.dtype, s.shape, self._mf.raw(name, data))
        q = self._mf.raw(name + ".q", data)
        sc = self._mf.raw(name + ".scales", data)
        return QTensor(s.dtype, s.shape, q, sc, s.group_size)

    def read_resident(self) -> dict[str, QTensor]:
        """Every tensor of the file, viewing one copy of its bytes in anonymous memory (none left
        in the page cache; the map is not touched). Aligned as in the file, C-contiguous."""
        data = self._mf.read_resident()
        if len(data) != self._mf.header.path.stat().st_size:
            raise FormatError(f"{self.label}: changed size while being read")
        return {name: self.get(name, data) for name in self.specs}

    def close(self) -> None:
        self._mf.close()

