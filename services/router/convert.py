"""Protobuf <-> router domain types: the one place where the two meet."""

from __future__ import annotations

import numpy as np

from moetier.errors import InvalidArgument
from moetier.placement import ExpertRange, PlacementMap
from moetier.rpc.v1 import dense_worker_pb2, generate_pb2, router_pb2
from services.router.core import ClusterView
from services.router.registry import LoadReport, MemberInfo, MemberKind
from services.router.scheduler import Route

_KIND_FROM_PB = {
    router_pb2.MEMBER_KIND_DENSE_WORKER: MemberKind.DENSE_WORKER,
    router_pb2.MEMBER_KIND_EXPERT_STORE: MemberKind.EXPERT_STORE,
}
_KIND_TO_PB = {v: k for k, v in _KIND_FROM_PB.items()}


def member_info_from_pb(req: router_pb2.RegisterRequest) -> MemberInfo:
    kind = _KIND_FROM_PB.get(req.kind)
    if kind is None:
        raise InvalidArgument(f"Register: kind must be dense worker or expert store (got {req.kind})")
    if not req.member_id:
        raise InvalidArgument("Register: member_id is empty")
    if not req.address:
        raise InvalidArgument(f"Register {req.member_id}: address is empty")
    owned = []
    for r in req.owned:
        if r.last <= r.first:
            raise InvalidArgument(f"Register {req.member_id}: empty expert range [{r.first}, {r.last}) "
                                  f"of layer {r.layer}")
        owned.append(ExpertRange(r.layer, r.first, r.last))
    if not req.read_bandwidth >= 0:  # also NaN
        raise InvalidArgument(f"Register {req.member_id}: read_bandwidth {req.read_bandwidth} is not >= 0")
    return MemberInfo(kind=kind, member_id=req.member_id, address=req.address,
                      metrics_address=req.metrics_address, model_id=req.model_id, owned=tuple(owned),
                      read_bandwidth=min(req.read_bandwidth, 1e15))


def load_from_pb(load: dense_worker_pb2.WorkerLoad) -> LoadReport:
    return LoadReport(running=load.running, waiting=load.waiting, kv_bytes=load.kv_bytes,
                      max_batch=load.max_batch, max_waiting=load.max_waiting,
                      prefix_hashes=set(load.prefix_hashes), prefix_block=load.prefix_block)


def heartbeat_load(req: router_pb2.HeartbeatRequest) -> LoadReport | None:
    return load_from_pb(req.load) if req.HasField("load") else None


def route_from_pb(req: generate_pb2.GenerateRequest) -> Route:
    if not req.prompt_ids:
        raise InvalidArgument(f"request {req.request_id!r}: prompt_ids is empty")
    return Route(request_id=req.request_id, prompt_ids=np.asarray(req.prompt_ids, dtype=np.uint32),
                 session_id=req.session_id if req.HasField("session_id") and req.session_id else None)


def register_response(heartbeat_interval_s: float, expiry_s: float) -> router_pb2.RegisterResponse:
    return router_pb2.RegisterResponse(heartbeat_interval_s=heartbeat_interval_s, expiry_s=expiry_s)


def _load_to_pb(load: LoadReport) -> dense_worker_pb2.WorkerLoad:
    # prefix_hashes stay out of the status: routing input (thousands of them), not status.
    return dense_worker_pb2.WorkerLoad(running=load.running, waiting=load.waiting, kv_bytes=load.kv_bytes,
                                       max_batch=load.max_batch, max_waiting=load.max_waiting,
                                       prefix_block=load.prefix_block)


def status_to_pb(view: ClusterView) -> router_pb2.ClusterStatusResponse:
    out = router_pb2.ClusterStatusResponse(queued=view.queued, queue_capacity=view.queue_capacity)
    for s in view.members:
        info = s.member.info
        m = out.members.add(kind=_KIND_TO_PB[info.kind], member_id=info.member_id, address=info.address,
                            metrics_address=info.metrics_address, model_id=info.model_id,
                            last_seen_s=s.last_seen_s, in_flight=s.in_flight,
                            read_bandwidth=info.read_bandwidth, placed_experts=s.placed_experts)
        if s.member.load is not None:
            m.load.CopyFrom(_load_to_pb(s.member.load))
        for r in info.owned:
            m.owned.add(layer=r.layer, first=r.first, last=r.last)
    return out


def placement_to_pb(version: int, pmap: PlacementMap | None) -> router_pb2.PlacementResponse:
    out = router_pb2.PlacementResponse(version=version, changed=pmap is not None)
    for st in pmap.stores if pmap is not None else ():
        out.stores.add(member_id=st.member_id, address=st.address, weight=st.weight,
                       owned=[router_pb2.ExpertRange(layer=r.layer, first=r.first, last=r.last) for r in st.owned])
    return out
