"""The router process: gRPC server (Router + grpc.health.v1), metrics endpoint, lifecycle.

    server, port = create_server(settings, "127.0.0.1:0")
    await server.start()
    ...
    await server.stop(grace=5)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moetier.rpc.errors import rpc_errors
from moetier.rpc.v1 import generate_pb2, router_pb2, router_pb2_grpc
from moetier.settings import Settings
from services.router import convert
from services.router.core import RouterCore

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin: protobuf in, domain call, protobuf out."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        # Written with context.write, not as an async generator: when the caller goes away
        # the handler's task is cancelled wherever it waits, and aclosing() then cancels the
        # worker call deterministically instead of whenever the generator is collected.
        async with rpc_errors(context, "Generate"):
            route = convert.route_from_pb(request)
            stream = self.core.generate(route, request, context.time_remaining())
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    await context.write(msg)

    async def Register(self, request: router_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> router_pb2.RegisterResponse:
        async with rpc_errors(context, "Register"):
            self.core.register(convert.member_info_from_pb(request))
            reg = self.core.registry
            return convert.register_response(reg.heartbeat_interval_s, reg.expiry_s)

    async def Heartbeat(self, request: router_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> router_pb2.HeartbeatResponse:
        async with rpc_errors(context, "Heartbeat"):
            known = self.core.heartbeat(request.member_id, convert.heartbeat_load(request))
            return router_pb2.HeartbeatResponse(known=known)

    async def ClusterStatus(self, request: router_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> router_pb2.ClusterStatusResponse:
        async with rpc_errors(context, "ClusterStatus"):
            return convert.status_to_pb(self.core.status())


class RouterServer:
    """The gRPC server plus what lives beside it: the expiry task, channels, /metrics."""

    def __init__(self, settings: Settings, core: RouterCore, server: grpc.aio.Server,
                 health_servicer: health.aio.HealthServicer) -> None:
        self.settings = settings
        self.core = core
        self._server = server
        self._health = health_servicer
        self._stop_metrics: Callable[[], None] | None = None

    async def start(self) -> None:
        await self._server.start()
        await self.core.start()
        host = self.settings.router.bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        self._stop_metrics = self.core.metrics.serve(host, self.settings.router.metrics_port)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls, give running streams `grace` seconds, then cancel them."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await self.core.stop()
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def create_server(settings: Settings, bind: str = "127.0.0.1:0") -> tuple[RouterServer, int]:
    """A router bound to `bind` (port 0: any free port), not yet started; and its port."""
    core = RouterCore(settings)
    # One server per port: without this gRPC sets SO_REUSEPORT, and a second server on the
    # same port would share it silently instead of failing to bind.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"router: cannot bind {bind}")
    return RouterServer(settings, core, server, health_servicer), port


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the router on settings.router.bind until SIGINT or SIGTERM, then stop gracefully."""
    server, port = create_server(settings, settings.router.bind)
    await server.start()
    log.info("router serving on %s (port %d)", settings.router.bind, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("router stopping (grace %.1f s)", grace_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop(grace_s)
