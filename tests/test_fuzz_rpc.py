"""Property-based fuzzing of every service's proto decoders (the `*_from_pb` functions the
servicers call first, and moetier.rpc.tensors.from_pb under them): malformed and oversized
tensors, wrong dtypes and shapes, dimensions whose product overflows int64, huge counts, and
messages parsed from arbitrary bytes. Each input is decoded into a request that satisfies
what the service then relies on, or refused with an InvalidArgument naming the field."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from helpers_fuzz import TIMEOUT_S, clean, fuzz_settings, seeded
from hypothesis import given
from hypothesis import strategies as st

from moetier.errors import InvalidArgument
from moetier.rpc.tensors import WIRE_DTYPES, from_pb
from moetier.rpc.v1 import expert_store_pb2, generate_pb2, router_pb2, tensor_pb2
from services.dense_worker.batcher import Limits
from services.dense_worker.convert import request_from_pb
from services.expert_store.convert import compute_from_pb, prefetch_from_pb
from services.expert_store.core import ModelShape
from services.router.convert import heartbeat_load, member_info_from_pb, route_from_pb

pytestmark = pytest.mark.timeout(TIMEOUT_S)

SHAPE = ModelShape(model_id="m", arch="test", hidden_size=8, moe_layers=(1, 3), n_experts=4, top_k=2,
                   record_bytes=4096, expert_dtype="int4")
LIMITS = Limits(max_batch=4, max_waiting=4, max_seq_len=64, prefill_chunk=16, vocab_size=100)
I64 = 2**63 - 1
DIM = st.one_of(st.integers(0, 9), st.sampled_from([2**31, 2**32, 2**33, 2**62, I64]),
                st.integers(-(2**63), I64))
DTYPE = st.one_of(st.sampled_from(WIRE_DTYPES), st.sampled_from(["float64", "int64", "object", "<f4", "", "V8"]),
                  st.text(max_size=8))


@st.composite
def tensors(draw: st.DrawFn, dtype: st.SearchStrategy[str] = DTYPE,
            shape: st.SearchStrategy[list[int]] | None = None) -> tensor_pb2.Tensor:
    """A Tensor whose data is as long as its shape says (sometimes) or any length (else)."""
    dt = draw(dtype)
    dims = draw(shape if shape is not None else st.lists(DIM, max_size=4))
    size = math.prod(dims) if all(d >= 0 for d in dims) else -1
    item = np.dtype(dt).itemsize if dt in WIRE_DTYPES else 4
    if 0 <= size * item <= 4096 and draw(st.booleans()):
        n = size * item
    else:
        n = draw(st.integers(0, 64))
    data = draw(st.binary(min_size=n, max_size=n))
    return tensor_pb2.Tensor(dtype=dt, shape=dims, data=data)


@seeded
@fuzz_settings(300)
@given(t=tensors(), dtype=st.one_of(st.none(), st.sampled_from(WIRE_DTYPES)), ndim=st.one_of(st.none(),
                                                                                                st.integers(0, 3)))
def test_fuzz_tensor_from_pb(t: tensor_pb2.Tensor, dtype: str | None, ndim: int | None) -> None:
    out: list[np.ndarray] = []
    err = clean(lambda: out.append(from_pb(t, "x", dtype, ndim)))
    if err is None:
        (a,) = out
        assert a.shape == tuple(t.shape) and a.dtype == np.dtype(t.dtype) and a.nbytes == len(t.data)
    else:
        assert isinstance(err, InvalidArgument) and str(err).startswith("x: ")


def _rows(t: int, d: int) -> st.SearchStrategy[list[int]]:
    return st.one_of(st.just([t, d]), st.lists(st.integers(0, 9), max_size=3))


@st.composite
def compute_requests(draw: st.DrawFn) -> expert_store_pb2.ComputeExpertsRequest:
    """Mostly well-shaped requests with one thing wrong: a row count, width, K, an id, a NaN."""
    t, k = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    d = draw(st.sampled_from([SHAPE.hidden_size, SHAPE.hidden_size, 0, 7, 9]))
    hidden = draw(st.one_of(st.just(np.zeros((t, d), np.float32)),
                            st.just(np.full((t, d), draw(st.sampled_from([np.nan, np.inf, 1e38])), np.float32))))
    ids = np.array(draw(st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 4), min_size=t * k,
                                 max_size=t * k)), dtype=np.int32).reshape(t, k)
    weights = np.full((t, k), draw(st.sampled_from([0.5, np.nan, -np.inf])), np.float32)
    req = expert_store_pb2.ComputeExpertsRequest(layer=draw(st.sampled_from([1, 3, 0, 2, 2**32 - 1])))
    for name, a in (("hidden", hidden), ("expert_ids", ids), ("weights", weights)):
        if draw(st.integers(0, 4)) == 0:  # this one malformed
            getattr(req, name).CopyFrom(draw(tensors()))
        else:
            getattr(req, name).CopyFrom(tensor_pb2.Tensor(dtype=a.dtype.name, shape=a.shape, data=a.tobytes()))
    return req


@seeded
@fuzz_settings(300)
@given(req=compute_requests())
def test_fuzz_expert_store_compute(req: expert_store_pb2.ComputeExpertsRequest) -> None:
    out = []
    err = clean(lambda: out.append(compute_from_pb(req, SHAPE)))
    if err is None:  # what the tier and the kernels rely on
        (b,) = out
        t, d = b.hidden.shape
        assert t > 0 and d == SHAPE.hidden_size and b.layer in SHAPE.moe_layers
        assert b.ids.shape == b.weights.shape and b.ids.shape[0] == t and b.ids.shape[1] >= 1
        assert ((b.ids >= 0) & (b.ids < SHAPE.n_experts)).all()
        assert np.isfinite(b.hidden).all() and np.isfinite(b.weights).all()
    else:
        assert isinstance(err, InvalidArgument)


@seeded
@fuzz_settings(100)
@given(layer=st.integers(0, 2**32 - 1) | st.sampled_from([1, 3]),
       ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 5), max_size=20))
def test_fuzz_expert_store_prefetch(layer: int, ids: list[int]) -> None:
    req = expert_store_pb2.PrefetchRequest(layer=layer, expert_ids=ids)
    out = []
    if clean(lambda: out.append(prefetch_from_pb(req, SHAPE))) is None:
        assert out[0].layer in SHAPE.moe_layers and ((out[0].ids >= 0) & (out[0].ids < SHAPE.n_experts)).all()


U32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 130))
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def generate_requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    p = generate_pb2.SamplingParams(temperature=draw(FLOATS), top_p=draw(FLOATS), top_k=draw(U32),
                                    presence_penalty=draw(FLOATS), frequency_penalty=draw(FLOATS),
                                    max_tokens=draw(U32), top_logprobs=draw(U32), logprobs=draw(st.booleans()),
                                    stop_token_ids=draw(st.lists(U32, max_size=4)))
    if draw(st.booleans()):
        p.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        p.grammar = draw(st.sampled_from(["", "  ", "start: \"a\""]))
    return generate_pb2.GenerateRequest(request_id=draw(st.text(max_size=8)), sampling=p,
                                        prompt_ids=draw(st.lists(U32, max_size=40)))


@seeded
@fuzz_settings(300)
@given(req=generate_requests())
def test_fuzz_dense_worker_generate(req: generate_pb2.GenerateRequest) -> None:
    out = []
    if clean(lambda: out.append(request_from_pb(req, LIMITS))) is None:  # what the batcher relies on
        r = out[0]
        s = r.params
        assert len(r.prompt) >= 1 and int(r.prompt.max()) < LIMITS.vocab_size
        assert len(r.prompt) + s.max_tokens <= LIMITS.max_seq_len and s.max_tokens >= 1
        assert math.isfinite(s.temperature) and s.temperature >= 0 and 0 < s.top_p <= 1
        assert abs(s.presence_penalty) <= 2 and abs(s.frequency_penalty) <= 2 and s.top_logprobs <= 20
        assert all(t < LIMITS.vocab_size for t in s.stop_token_ids)
    route = []
    if clean(lambda: route.append(route_from_pb(req))) is None:
        assert len(route[0].prompt_ids) == len(req.prompt_ids) >= 1


@seeded
@fuzz_settings(200)
@given(kind=st.integers(-1, 5), member=st.text(max_size=6), address=st.text(max_size=12),
       owned=st.lists(st.tuples(U32, U32, U32), max_size=5),
       hashes=st.lists(st.integers(0, 2**64 - 1), max_size=20), load=st.booleans())
def test_fuzz_router_register_and_heartbeat(kind: int, member: str, address: str,
                                            owned: list[tuple[int, int, int]], hashes: list[int],
                                            load: bool) -> None:
    req = router_pb2.RegisterRequest(kind=kind, member_id=member, address=address,  # type: ignore[arg-type]
                                     owned=[router_pb2.ExpertRange(layer=a, first=b, last=c) for a, b, c in owned])
    out = []
    if clean(lambda: out.append(member_info_from_pb(req))) is None:
        assert out[0].member_id and out[0].address and all(r.first < r.last for r in out[0].owned)
    hb = router_pb2.HeartbeatRequest(member_id=member)
    if load:
        hb.load.prefix_hashes.extend(hashes)
    clean(lambda: heartbeat_load(hb))


MESSAGES: list[Any] = [expert_store_pb2.ComputeExpertsRequest, expert_store_pb2.PrefetchRequest, generate_pb2.GenerateRequest,
            router_pb2.RegisterRequest, router_pb2.HeartbeatRequest]


@seeded
@fuzz_settings(300)
@given(which=st.sampled_from(range(len(MESSAGES))), raw=st.binary(max_size=200))
def test_fuzz_decoders_on_arbitrary_bytes(which: int, raw: bytes) -> None:
    """What gRPC hands a servicer after parsing any bytes: a DecodeError (gRPC refuses the call)
    or a message, which the decoder then takes or refuses with InvalidArgument."""
    cls = MESSAGES[which]
    try:
        msg = cls.FromString(raw)
    except DecodeError:
        return
    decode = {
        expert_store_pb2.ComputeExpertsRequest: lambda: compute_from_pb(msg, SHAPE),
        expert_store_pb2.PrefetchRequest: lambda: prefetch_from_pb(msg, SHAPE),
        generate_pb2.GenerateRequest: lambda: (request_from_pb(msg, LIMITS), route_from_pb(msg)),
        router_pb2.RegisterRequest: lambda: member_info_from_pb(msg),
        router_pb2.HeartbeatRequest: lambda: heartbeat_load(msg),
    }[cls]
    clean(decode)
