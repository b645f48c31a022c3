"""numpy <-> moetier.v1.Tensor. The receiver checks every size: a wrong dtype, shape or
byte count is an InvalidArgument naming the field, never a reshape error deep inside."""

from __future__ import annotations

import numpy as np

from moetier.errors import InvalidArgument
from moetier.rpc.v1 import tensor_pb2

WIRE_DTYPES = ("float32", "int32", "float16", "uint8", "uint32")


def to_pb(a: np.ndarray) -> tensor_pb2.Tensor:
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    if dt.name not in WIRE_DTYPES:
        raise InvalidArgument(f"dtype {a.dtype} cannot cross the wire; expected one of {WIRE_DTYPES}")
    return tensor_pb2.Tensor(dtype=dt.name, shape=list(a.shape), data=a.astype(dt, copy=False).tobytes())


def from_pb(
    t: tensor_pb2.Tensor,
    field: str,
    dtype: str | None = None,
    ndim: int | None = None,
) -> np.ndarray:
    """Decode and check a Tensor. `field` names it in errors ("hidden", "expert_ids", ...)."""
    if not t.dtype:
        raise InvalidArgument(f"{field}: missing tensor")
    if t.dtype not in WIRE_DTYPES:
        raise InvalidArgument(f"{field}: unsupported dtype {t.dtype!r}")
    if dtype is not None and t.dtype != dtype:
        raise InvalidArgument(f"{field}: dtype {t.dtype} where {dtype} is required")
    shape = tuple(int(s) for s in t.shape)
    if ndim is not None and len(shape) != ndim:
        raise InvalidArgument(f"{field}: {len(shape)}-D tensor of shape {list(shape)} where {ndim}-D is required")
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{field}: negative dimension in shape {list(shape)}")
    dt = np.dtype(t.dtype).newbyteorder("<")
    expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(t.data) != expected:
        raise InvalidArgument(
            f"{field}: {len(t.data)} bytes for shape {list(shape)} {t.dtype} (expected {expected})"
        )
    return np.frombuffer(t.data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=False)
