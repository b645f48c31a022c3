"""Protobuf <-> expert store domain types: the one place where the two meet.

Requests are checked here, against the served model's shape, before anything else sees
them: a wrong request is an InvalidArgument naming the field and the problem, never an
error from deep inside the tier or the kernels.

Legend: T = rows, D = hidden, K = experts per row, E = experts per layer.
"""

from __future__ import annotations

import mmap

import numpy as np

from moetier.errors import InvalidArgument
from moetier.rpc.local import LocalServer
from moetier.rpc.tensors import from_pb, to_pb
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.store.compute import ComputeResult
from services.expert_store.core import (
    ComputeBatch,
    ModelShape,
    PrefetchHint,
    PrefetchResult,
    SharedUsage,
    StoreHeat,
    StoreInfo,
)


def _check_layer(layer: int, shape: ModelShape) -> None:
    if layer not in shape.moe_layers:
        raise InvalidArgument(f"layer {layer} is not a MoE layer of this model (MoE layers: "
                              f"{', '.join(str(x) for x in shape.moe_layers)})")


def _check_ids(ids: np.ndarray, shape: ModelShape, what: str, unset_ok: bool = False) -> None:
    bad = (ids < (-1 if unset_ok else 0)) | (ids >= shape.n_experts)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgument(f"{what}: expert id {int(ids[at])} at {list(at)} is outside [0, {shape.n_experts})")


def compute_from_pb(req: pb.ComputeExpertsRequest, shape: ModelShape, region: mmap.mmap | None = None) -> ComputeBatch:
    """`region`: the local lane's shared memory, where its calls' tensors are (None on gRPC)."""
    _check_layer(req.layer, shape)
    hidden = from_pb(req.hidden, "hidden", dtype="float32", ndim=2, region=region)  # [T, D]
    ids = from_pb(req.expert_ids, "expert_ids", dtype="int32", ndim=2, region=region)  # [T, K]
    weights = from_pb(req.weights, "weights", dtype="float32", ndim=2, region=region)  # [T, K]
    t, d = hidden.shape
    if t == 0:
        raise InvalidArgument("hidden: empty batch (T = 0 rows)")
    if d != shape.hidden_size:
        raise InvalidArgument(f"hidden: rows of width {d}, the model's hidden size is {shape.hidden_size}")
    if ids.shape[0] != t or weights.shape[0] != t:
        raise InvalidArgument(f"row count mismatch: hidden has {t} rows, expert_ids {ids.shape[0]}, "
                              f"weights {weights.shape[0]}")
    if ids.shape[1] != weights.shape[1]:
        raise InvalidArgument(f"K mismatch: expert_ids {list(ids.shape)} and weights {list(weights.shape)} "
                              f"must have the same shape [T, K]")
    if ids.shape[1] < 1:
        raise InvalidArgument("expert_ids: K = 0 experts per row (need at least 1)")
    slots = req.HasField("slot_outputs") and req.slot_outputs
    _check_ids(ids, shape, "expert_ids", unset_ok=slots)
    if slots and not (ids >= 0).any():
        raise InvalidArgument("expert_ids: every slot is -1 (slot_outputs needs at least one expert to compute)")
    for name, a in (("hidden", hidden), ("weights", weights)):
        if not np.isfinite(a).all():
            at = [int(i) for i in np.argwhere(~np.isfinite(a))[0]]
            raise InvalidArgument(f"{name}: non-finite value {a[tuple(at)]} at {at}")
    return ComputeBatch(layer=req.layer, hidden=hidden, ids=ids, weights=weights,
                        step=req.step if req.HasField("step") else None, slot_outputs=slots)


def compute_to_pb(r: ComputeResult, with_output: bool = True) -> pb.ComputeExpertsResponse:
    """with_output=False: the output is the caller's to place (the local lane's region)."""
    resp = pb.ComputeExpertsResponse(hits=r.hits, misses=r.misses, load_ns=r.load_ns, compute_ns=r.compute_ns,
                                     settled=r.settled)
    if with_output:
        resp.output.CopyFrom(to_pb(r.output))
    return resp


def usage_from_pb(msg: pb.LocalUsage, shape: ModelShape) -> SharedUsage:
    """A LocalUsage checked (layers, expert ids, non-negative counts) and grouped by layer."""
    ex = from_pb(msg.experts, "experts", dtype="int32", ndim=2).astype(np.int64)  # [N, 4]
    ly = from_pb(msg.layers, "layers", dtype="int64", ndim=2)  # [M, 3]
    if ex.shape[1] != 4 or ly.shape[1] != 3:
        raise InvalidArgument(f"usage: experts {list(ex.shape)} and layers {list(ly.shape)}, expected [N, 4] "
                              "and [M, 3]")
    if (ex[:, 2:] < 0).any() or (ly[:, 1:] < 0).any():
        raise InvalidArgument("usage: negative counts")
    for layer in np.unique(np.concatenate([ex[:, 0], ly[:, 0]])).tolist():
        _check_layer(int(layer), shape)
    _check_ids(ex[:, 1], shape, "usage experts")
    experts = [(int(layer), ex[ex[:, 0] == layer, 1], ex[ex[:, 0] == layer, 2], ex[ex[:, 0] == layer, 3])
               for layer in np.unique(ex[:, 0]).tolist()]
    return SharedUsage(experts, [(int(a), int(b), int(c)) for a, b, c in ly.tolist()])


def prefetch_from_pb(req: pb.PrefetchRequest, shape: ModelShape) -> PrefetchHint:
    _check_layer(req.layer, shape)
    ids = np.asarray(req.expert_ids, dtype=np.int64)  # [n]
    _check_ids(ids, shape, "expert_ids")
    return PrefetchHint(layer=req.layer, ids=ids, step=req.step if req.HasField("step") else None)


def prefetch_to_pb(r: PrefetchResult) -> pb.PrefetchResponse:
    return pb.PrefetchResponse(queued=r.queued, resident=r.resident, dropped=r.dropped)


def _disk_state(state: str, files: int) -> str:
    return "absent" if state != "ok" and files == 0 else state


def info_to_pb(info: StoreInfo, lane: LocalServer | None = None) -> pb.InfoResponse:
    s = info.shape
    return pb.InfoResponse(
        local_socket=lane.name if lane is not None else "", local_token=lane.token if lane is not None else "",
        model_id=s.model_id, arch=s.arch, hidden_size=s.hidden_size, moe_layers=list(s.moe_layers),
        n_experts=s.n_experts, top_k=s.top_k, record_bytes=s.record_bytes, budget_bytes=info.budget_bytes,
        policy=info.policy, expert_dtype=s.expert_dtype, store_id=info.store_id,
        owned=[pb.OwnedRange(layer=r.layer, first=r.first, last=r.last) for r in info.owned],
        read_bandwidth=info.read_bandwidth,
        disks=[pb.DiskInfo(name=d.name, path=d.path, state=_disk_state(d.state, d.files), weight=d.weight,
                           files=d.files) for d in info.disks])


def heat_to_pb(h: StoreHeat) -> pb.HeatResponse:
    return pb.HeatResponse(moe_layers=list(h.layers), n_experts=h.counts.shape[1], counts=to_pb(h.counts),
                           tier=to_pb(h.tier), recent=to_pb(h.recent), disks=h.disks,
                           resident_bytes=h.resident_bytes, budget_bytes=h.budget_bytes, step=h.step)
