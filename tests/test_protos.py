"""The committed gRPC stubs match proto/, and tensors cross the wire checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetier.errors import InvalidArgument
from moetier.rpc.tensors import from_pb, to_pb

ROOT = Path(__file__).resolve().parent.parent


def test_stubs_match_protos() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("dtype", ["float32", "int32", "float16", "uint8", "uint32"])
def test_tensor_round_trip(dtype: str) -> None:
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    b = from_pb(to_pb(a), "x", dtype=dtype, ndim=3)
    assert b.dtype == a.dtype and np.array_equal(a, b)


def test_tensor_checks() -> None:
    t = to_pb(np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidArgument, match="hidden: dtype float32 where int32"):
        from_pb(t, "hidden", dtype="int32")
    with pytest.raises(InvalidArgument, match="2-D tensor"):
        from_pb(t, "hidden", ndim=3)
    t.data = t.data[:-4]
    with pytest.raises(InvalidArgument, match="20 bytes for shape"):
        from_pb(t, "hidden")
    with pytest.raises(InvalidArgument, match="cannot cross the wire"):
        to_pb(np.zeros(2, np.float64))
