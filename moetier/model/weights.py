"""The dense tensors a model needs, checked once at load, and row-wise embedding lookup.

Legend: V = vocab, D = hidden, n = looked-up rows. The list of tensors and their shapes is
moetier.weights.schema.dense_shapes (names documented in moetier/convert/adapters/base.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from moetier.errors import FormatError
from moetier.model.config import ModelArgs
from moetier.weights.quant import QTensor
from moetier.weights.schema import dense_shapes

F32 = npt.NDArray[np.float32]


def check_dense(args: ModelArgs, dense: Mapping[str, QTensor]) -> None:
    """Raise FormatError naming the first missing or misshapen tensor."""
    for name, shape in dense_shapes(args).items():
        t = dense.get(name)
        if t is None:
            raise FormatError(f"dense tensor {name!r} is missing (expected shape {list(shape)})")
        if tuple(t.shape) != shape:
            raise FormatError(f"dense tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")


def vector(t: QTensor) -> F32:
    """A 1-D tensor (norm weight, bias) as float32."""
    return np.ascontiguousarray(t.dequantize(), dtype=np.float32).reshape(-1)


def embed_rows(embed: QTensor, ids: npt.NDArray[np.integer]) -> F32:
    """Rows `ids` of the embedding [V, D] -> [n, D], dequantizing only those rows."""
    rows = QTensor(
        embed.dtype,
        (len(ids), embed.shape[1]),
        embed.data[ids],
        None if embed.scales is None else embed.scales[ids],
        embed.group_size,
    )
    return np.ascontiguousarray(rows.dequantize(), dtype=np.float32)
