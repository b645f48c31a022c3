"""numpy <-> moetier.v1.Tensor. The receiver checks every size: a wrong dtype, shape or
byte count is an InvalidArgument naming the field, never a reshape error deep inside.

On a local lane (moetier/rpc/local.py) a tensor's bytes may sit in the lane's shared memory
region instead of the message (`Tensor.shared`): `to_shared` writes them there, `from_pb`
with the region reads a zero-copy view, checked like bytes are."""

from __future__ import annotations

import math
import mmap

import numpy as np

from moetier.errors import InvalidArgument
from moetier.rpc.v1 import tensor_pb2

WIRE_DTYPES = ("float32", "int32", "float16", "uint8", "uint32", "int64")
MAX_NDIM = 8  # no tensor of the protocol has more than 3; numpy's own limit is 64
MAX_BYTES = 2**31  # a protobuf message is at most 2 GiB


# Each wire dtype by name: little-endian (its bytes on the wire) and native (what a decoded view
# is); and the wire name of each numpy dtype that crosses as one (either byte order). Looked up
# rather than derived per tensor: numpy computes `dtype.name` in Python, a few microseconds a
# call, and a decode step moves a dozen tensors per MoE layer.
_LITTLE = {n: np.dtype(n).newbyteorder("<") for n in WIRE_DTYPES}
_NATIVE = {n: np.dtype(n).newbyteorder("=") for n in WIRE_DTYPES}
_WIRE_NAME = {d: n for n, le in _LITTLE.items() for d in (le, le.newbyteorder(">"))}  # native is one of them


def _wire(a: np.ndarray) -> tuple[str, np.dtype]:
    """The wire name and little-endian dtype of `a`'s dtype; InvalidArgument when it has none."""
    name = _WIRE_NAME.get(a.dtype)
    if name is None:
        raise InvalidArgument(f"dtype {a.dtype} cannot cross the wire; expected one of {WIRE_DTYPES}")
    return name, _LITTLE[name]


def to_pb(a: np.ndarray) -> tensor_pb2.Tensor:
    a = np.ascontiguousarray(a)
    name, dt = _wire(a)
    return tensor_pb2.Tensor(dtype=name, shape=list(a.shape), data=a.astype(dt, copy=False).tobytes())


SHARED_ALIGN = 64  # offsets of tensors in a shared region


def to_shared(a: np.ndarray, region: mmap.mmap, offset: int) -> tuple[tensor_pb2.Tensor, int]:
    """Write `a` into `region` at `offset` (a multiple of SHARED_ALIGN); the Tensor naming it,
    and the next free aligned offset. ValueError when it does not fit."""
    a = np.ascontiguousarray(a)
    name, dt = _wire(a)
    end = offset + a.nbytes
    if offset % SHARED_ALIGN or end > len(region):
        raise ValueError(f"{a.nbytes} bytes at offset {offset} do not fit the {len(region)}-byte region")
    np.frombuffer(region, dtype=np.uint8, count=a.nbytes, offset=offset)[:] = a.astype(dt, copy=False).view(np.uint8).reshape(-1)
    t = tensor_pb2.Tensor(dtype=name, shape=list(a.shape), shared=tensor_pb2.SharedSlice(offset=offset))
    return t, -(-end // SHARED_ALIGN) * SHARED_ALIGN


def from_pb(
    t: tensor_pb2.Tensor,
    field: str,
    dtype: str | None = None,
    ndim: int | None = None,
    region: mmap.mmap | None = None,
) -> np.ndarray:
    """Decode and check a Tensor. `field` names it in errors ("hidden", "expert_ids", ...).
    `region`: the local lane's shared memory, where a `shared` tensor's bytes are (a view of
    them is returned: valid while the lane's peer leaves them alone, i.e. for the call)."""
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
    if len(shape) > MAX_NDIM:
        raise InvalidArgument(f"{field}: {len(shape)}-D tensor (at most {MAX_NDIM} dimensions)")
    dt, native = _LITTLE[t.dtype], _NATIVE[t.dtype]
    if math.prod(d for d in shape if d) * dt.itemsize > MAX_BYTES:  # even beside a 0, numpy refuses these
        raise InvalidArgument(f"{field}: shape {list(shape)} has dimensions beyond any message ({MAX_BYTES} bytes)")
    expected = math.prod(shape) * dt.itemsize  # Python ints: a product past int64 does not wrap to a fit
    if t.HasField("shared"):
        if region is None:
            raise InvalidArgument(f"{field}: a shared-memory tensor outside a local lane")
        off = t.shared.offset
        if t.data or off % SHARED_ALIGN or off + expected > len(region):
            raise InvalidArgument(f"{field}: shared slice at offset {off} of {expected} bytes for shape "
                                  f"{list(shape)} {t.dtype} is not inside the {len(region)}-byte region")
        view = np.frombuffer(region, dtype=dt, count=math.prod(shape), offset=off)
        return view.reshape(shape).astype(native, copy=False)
    if len(t.data) != expected:
        raise InvalidArgument(
            f"{field}: {len(t.data)} bytes for shape {list(shape)} {t.dtype} (expected {expected})"
        )
    return np.frombuffer(t.data, dtype=dt).reshape(shape).astype(native, copy=False)
