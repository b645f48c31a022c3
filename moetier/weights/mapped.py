"""Expert records served from memory-mapped files: the MTP head's experts (mtp/experts/).

Legend: T = rows, D = hidden, K = experts per token.

The MTP layers' routed experts are read where they are used, by the process that runs the head,
through np.memmap views of their files: the page cache holds the ones in use and the kernel
drops the others under memory pressure, so a 10 GB int8 head (GLM-5's) needs no RAM budget of
its own. Each record's checksum is verified the first time it is used; a corrupt record fails
the step loudly (DataCorruption), never wrong math. The views are parsed zero-copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from moetier.errors import DataCorruption
from moetier.model.ops import Ops
from moetier.weights.container import Container
from moetier.weights.format import xxh3_hex
from moetier.weights.layout import RecordLayout
from moetier.weights.quant import ExpertWeights

F32 = npt.NDArray[np.float32]


class MappedExperts:
    """ExpertProvider over records of `layers` in memory-mapped container files."""

    def __init__(self, container: Container, layers: Iterable[int], layout: RecordLayout, ops: Ops) -> None:
        self.container, self.layout, self.ops = container, layout, ops
        self.layers = set(layers)
        self._maps: dict[str, np.memmap] = {}
        self._parsed: dict[tuple[int, int], ExpertWeights] = {}
        self.verified = 0  # records checked so far

    def _expert(self, layer: int, expert: int) -> ExpertWeights:
        got = self._parsed.get((layer, expert))
        if got is not None:
            return got
        if layer not in self.layers:
            raise KeyError(f"expert layer {layer} is not served here (layers {sorted(self.layers)})")
        index = self.container.index_of(layer)
        loc = index.location((layer, expert))
        path = index.root / loc.path
        mm = self._maps.get(str(path))
        if mm is None:
            mm = self._maps[str(path)] = np.memmap(path, dtype=np.uint8, mode="r")
        view = mm[loc.offset : loc.offset + loc.length]
        ck = xxh3_hex(np.ascontiguousarray(view).tobytes())
        if ck != loc.checksum_hex:
            raise DataCorruption(f"{path}: checksum mismatch for layer {layer} expert {expert} at offset "
                                 f"{loc.offset} ({loc.length} bytes): expected {loc.checksum_hex}, got {ck}")
        self.verified += 1
        ew = self._parsed[(layer, expert)] = self.layout.parse(view)
        return ew

    def moe(self, layer: int, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> F32:
        """x [T, D], ids/weights [T, K] -> [T, D]."""
        needed = {int(e): self._expert(layer, int(e)) for e in np.unique(ids)}
        return self.ops.moe(x, ids, weights, needed)

    def prefetch(self, layer: int, ids: npt.NDArray[np.int32]) -> None:
        pass  # the page cache reads ahead on its own

    def close(self) -> None:
        self._parsed.clear()
        self._maps.clear()
