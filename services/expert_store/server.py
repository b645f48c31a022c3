"""The expert store process: gRPC server (ExpertStore + grpc.health.v1), metrics endpoint,
router membership, lifecycle.

    server, port = create_server(settings, "127.0.0.1:0")
    await server.start()        # NOT_SERVING until the kernels are warm, then SERVING
    ...
    await server.stop(grace=5)  # usage history saved, files closed

Clients must raise their receive limit (`grpc.max_receive_message_length`) like the
server does: a ComputeExperts answer is T x D x 4 bytes.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os

import grpc
import numpy as np

from moetier.cluster import MemberAgent
from moetier.rpc.errors import rpc_errors
from moetier.rpc.local import LocalServer
from moetier.rpc.serving import ServiceServer, listen, new_server, run_until_signal, with_bound_port
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.settings import Settings
from moetier.wake_latency import hold_wake_latency
from services.expert_store import convert
from services.expert_store.core import StoreCore

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertStore"].full_name
MAX_MESSAGE_BYTES = 1 << 30  # as the dense worker's channel: a prefill chunk of a wide model is tens of MB
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class ExpertStoreServicer(pb_grpc.ExpertStoreServicer):
    """Thin: protobuf in, domain call, protobuf out."""

    def __init__(self, core: StoreCore, lane: LocalServer | None = None) -> None:
        self.core = core
        self.lane = lane

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        async with rpc_errors(context, "Info"):
            return convert.info_to_pb(self.core.info(), self.lane)

    async def ComputeExperts(self, request: pb.ComputeExpertsRequest,
                             context: grpc.aio.ServicerContext) -> pb.ComputeExpertsResponse:
        async with rpc_errors(context, "ComputeExperts"):
            with self.core.metrics.count_errors():
                batch = convert.compute_from_pb(request, self.core.shape)
                return convert.compute_to_pb(await self.core.compute(batch))

    async def Prefetch(self, request: pb.PrefetchRequest,
                       context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        async with rpc_errors(context, "Prefetch"):
            hint = convert.prefetch_from_pb(request, self.core.shape)
            return convert.prefetch_to_pb(self.core.prefetch(hint))

    async def Heat(self, request: pb.HeatRequest, context: grpc.aio.ServicerContext) -> pb.HeatResponse:
        async with rpc_errors(context, "Heat"):
            return convert.heat_to_pb(await self.core.aheat())


class StoreServer(ServiceServer[StoreCore]):
    """The gRPC server plus what lives beside it: the core, health, /metrics, the router agent,
    the local lane. Starting warms the kernels while health says NOT_SERVING; stopping closes
    the lane (its calls in flight get the grace period to finish, as gRPC's do), gives running
    gRPC calls the grace period, then saves the usage history and closes the files."""

    def __init__(self, settings: Settings, core: StoreCore, server: grpc.aio.Server,
                 agent: MemberAgent | None, lane: LocalServer | None = None) -> None:
        super().__init__("expert store", SERVICE_NAME, settings.expert_store, core, server, agent)
        self.lane = lane

    async def start(self) -> None:
        if self.lane is not None:
            self.lane.start()
            self.log.info("local lane %s", self.lane.name)
        await super().start()

    async def stop(self, grace: float | None) -> None:
        if self.lane is not None:
            await asyncio.to_thread(self.lane.close, grace)
        await super().stop(grace)


def open_lane(core: StoreCore) -> LocalServer | None:
    """The store's local lane (Linux: an abstract unix socket and memfd regions), its calls
    converted here and computed by `core.compute_here` on the lane's connection thread."""
    if not hasattr(os, "memfd_create"):
        return None

    def compute(req: pb.ComputeExpertsRequest, region: mmap.mmap) -> tuple[pb.ComputeExpertsResponse, np.ndarray]:
        with core.metrics.count_errors():
            result = core.compute_here(convert.compute_from_pb(req, core.shape, region))
        return convert.compute_to_pb(result, with_output=False), result.output

    def prefetch(req: pb.PrefetchRequest) -> None:
        core.prefetch(convert.prefetch_from_pb(req, core.shape))

    def usage(msg: pb.LocalUsage) -> None:
        core.note_shared(convert.usage_from_pb(msg, core.shape))

    try:
        return LocalServer(compute, prefetch, shared=core.shared_offer, usage=usage)
    except OSError as e:
        logging.getLogger(__name__).warning("no local lane (%s): callers on this host use gRPC", e)
        return None


def create_server(settings: Settings, bind: str = "127.0.0.1:0", *, register: bool = False,
                  threads: int | None = None, history_interval_s: float = 30.0,
                  local_lane: bool = True) -> tuple[StoreServer, int]:
    """An expert store bound to `bind` (port 0: any free port), not yet started; and its port.
    register: join the router at settings.router.address (as settings.expert_store.id, reachable
    at settings.expert_store.address, port 0 there meaning the bound port). threads: kernel threads
    per call (default: core.kernel_threads()). history_interval_s: learned policy history saves.
    local_lane: also serve the local lane (moetier/rpc/local.py) where the platform has one."""
    core = StoreCore(settings, threads=threads, history_interval_s=history_interval_s)
    lane = None
    try:
        server = new_server(GRPC_OPTIONS)
        lane = open_lane(core) if local_lane else None
        pb_grpc.add_ExpertStoreServicer_to_server(ExpertStoreServicer(core, lane), server)
        port = listen(server, bind, "expert store")
    except BaseException:
        if lane is not None:
            lane.close()
        core.close()
        raise
    agent = None
    if register:
        settings = with_bound_port(settings, "expert_store", port)
        bandwidth = core.probe_bandwidth()  # the weight of its share in the placement map
        agent = MemberAgent.from_settings(settings, "expert_store", model_id=core.shape.model_id,
                                          owned=[(r.layer, r.first, r.last) for r in core.owned],
                                          read_bandwidth=bandwidth, drain_on_stop=True)
    return StoreServer(settings, core, server, agent, lane), port


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the store on settings.expert_store.bind until SIGINT or SIGTERM, then stop gracefully.
    Joins the router when settings.router.address is set (an empty address: standalone)."""
    server, port = create_server(settings, settings.expert_store.bind, register=bool(settings.router.address))
    with hold_wake_latency(settings.kernels.max_wake_latency_us):
        await run_until_signal(server, port, grace_s)
