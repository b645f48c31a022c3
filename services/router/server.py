"""The router process: gRPC server (Router + grpc.health.v1), metrics endpoint, lifecycle.

    server, port = create_server(settings, "127.0.0.1:0")
    await server.start()
    ...
    await server.stop(grace=5)
"""

from __future__ import annotations

import contextlib

import grpc

from moetier.rpc.errors import rpc_errors
from moetier.rpc.serving import ServiceServer, listen, new_server, run_until_signal
from moetier.rpc.v1 import generate_pb2, router_pb2, router_pb2_grpc
from moetier.settings import Settings
from services.router import convert
from services.router.core import RouterCore

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
            known = self.core.heartbeat(request.member_id, convert.heartbeat_load(request),
                                        draining=request.draining)
            return router_pb2.HeartbeatResponse(known=known)

    async def ClusterStatus(self, request: router_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> router_pb2.ClusterStatusResponse:
        async with rpc_errors(context, "ClusterStatus"):
            return convert.status_to_pb(self.core.status())

    async def Placement(self, request: router_pb2.PlacementRequest,
                        context: grpc.aio.ServicerContext) -> router_pb2.PlacementResponse:
        async with rpc_errors(context, "Placement"):
            known = request.known_version if request.HasField("known_version") else None
            return convert.placement_to_pb(*self.core.placement(known))


class RouterServer(ServiceServer[RouterCore]):
    """The gRPC server plus what lives beside it: the core (registry, scheduler, expiry task,
    worker channels), health, /metrics. Stopping gives running streams the grace period, then
    cancels them."""

    def __init__(self, settings: Settings, core: RouterCore, server: grpc.aio.Server) -> None:
        super().__init__("router", SERVICE_NAME, settings.router, core, server)


def create_server(settings: Settings, bind: str = "127.0.0.1:0") -> tuple[RouterServer, int]:
    """A router bound to `bind` (port 0: any free port), not yet started; and its port."""
    core = RouterCore(settings)
    server = new_server()
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), server)
    service = RouterServer(settings, core, server)
    return service, listen(server, bind, "router")


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the router on settings.router.bind until SIGINT or SIGTERM, then stop gracefully."""
    server, port = create_server(settings, settings.router.bind)
    await run_until_signal(server, port, grace_s)
