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
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moetier.cluster import MemberAgent
from moetier.rpc.errors import rpc_errors
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.settings import Settings
from services.expert_store import convert
from services.expert_store.core import StoreCore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertStore"].full_name
MAX_MESSAGE_BYTES = 1 << 30  # as the dense worker's channel: a prefill chunk of a wide model is tens of MB
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class ExpertStoreServicer(pb_grpc.ExpertStoreServicer):
    """Thin: protobuf in, domain call, protobuf out."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        async with rpc_errors(context, "Info"):
            return convert.info_to_pb(self.core.info())

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


class StoreServer:
    """The gRPC server plus what lives beside it: the core, /metrics, the router agent."""

    def __init__(self, settings: Settings, core: StoreCore, server: grpc.aio.Server,
                 health_servicer: health.aio.HealthServicer, agent: MemberAgent | None) -> None:
        self.settings = settings
        self.core = core
        self.agent = agent
        self._server = server
        self._health = health_servicer
        self._stop_metrics: Callable[[], None] | None = None

    async def start(self) -> None:
        """Accept calls at once (health says NOT_SERVING), warm the kernels, then SERVING."""
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        await self.core.start()
        ep = self.settings.expert_store
        host = ep.bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        self._stop_metrics = self.core.metrics.serve(host, ep.metrics_port)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.agent is not None:
            self.agent.start()  # retries in the background while the router is down

    async def stop(self, grace: float | None) -> None:
        """Leave the router, refuse new calls, give running ones `grace` seconds, close the store."""
        if self.agent is not None:
            await self.agent.stop()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await self.core.stop()
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def create_server(settings: Settings, bind: str = "127.0.0.1:0", *, register: bool = False,
                  threads: int | None = None, history_interval_s: float = 30.0) -> tuple[StoreServer, int]:
    """An expert store bound to `bind` (port 0: any free port), not yet started; and its port.
    register: join the router at settings.router.address (as settings.expert_store.id, reachable
    at settings.expert_store.address, port 0 there meaning the bound port). threads: kernel threads
    per call (default: core.kernel_threads()). history_interval_s: learned policy history saves."""
    core = StoreCore(settings, threads=threads, history_interval_s=history_interval_s)
    try:
        # One server per port: without this gRPC sets SO_REUSEPORT, and a second server on the
        # same port would share it silently instead of failing to bind.
        server = grpc.aio.server(options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
        pb_grpc.add_ExpertStoreServicer_to_server(ExpertStoreServicer(core), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"expert store: cannot bind {bind}")
    except BaseException:
        core.close()
        raise
    agent = None
    if register:
        ep = settings.expert_store
        host, _, want = ep.address.rpartition(":")
        if want == "0":
            settings = settings.model_copy(update={"expert_store": ep.model_copy(
                update={"address": f"{host}:{port}"})})
        shape = core.shape
        agent = MemberAgent.from_settings(settings, "expert_store", model_id=shape.model_id,
                                          owned=[(layer, 0, shape.n_experts) for layer in shape.moe_layers])
    return StoreServer(settings, core, server, health_servicer, agent), port


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the store on settings.expert_store.bind until SIGINT or SIGTERM, then stop gracefully.
    Joins the router when settings.router.address is set (an empty address: standalone)."""
    server, port = create_server(settings, settings.expert_store.bind, register=bool(settings.router.address))
    await server.start()
    log.info("expert store serving on %s (port %d)", settings.expert_store.bind, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("expert store stopping (grace %.1f s)", grace_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop(grace_s)
    log.info("expert store stopped")
