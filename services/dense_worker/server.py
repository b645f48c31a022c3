"""The dense worker process: gRPC server (DenseWorker + grpc.health.v1), metrics endpoint,
router membership, lifecycle.

    server, port = create_server(settings, "127.0.0.1:0")
    await server.start()
    ...
    await server.stop(grace=5)
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moetier.cluster import MemberAgent
from moetier.errors import InvalidArgument
from moetier.rpc.errors import rpc_errors
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc, generate_pb2
from moetier.settings import Settings
from services.dense_worker import convert
from services.dense_worker.core import WorkerCore

log = logging.getLogger(__name__)

SERVICE_NAME = dense_worker_pb2.DESCRIPTOR.services_by_name["DenseWorker"].full_name


class DenseWorkerServicer(dense_worker_pb2_grpc.DenseWorkerServicer):
    """Thin: protobuf in, domain call, protobuf out."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # context.write rather than an async generator: when the caller goes away the handler's
        # task is cancelled where it waits, and `finally` releases the sequence at once.
        async with rpc_errors(context, "Generate"):
            try:
                req = convert.request_from_pb(request, self.core.limits)
            except InvalidArgument:
                self.core.note_invalid()
                raise
            seq = self.core.submit(req)
            try:
                async for out in seq.outputs():
                    await context.write(convert.response_to_pb(out, self.core.worker_id))
            finally:
                self.core.release(seq)

    async def Load(self, request: dense_worker_pb2.LoadRequest,
                   context: grpc.aio.ServicerContext) -> dense_worker_pb2.WorkerLoad:
        async with rpc_errors(context, "Load"):
            return convert.load_to_pb(self.core.load())


class WorkerServer:
    """The gRPC server plus what lives beside it: the core, /metrics, the router agent."""

    def __init__(self, settings: Settings, core: WorkerCore, server: grpc.aio.Server,
                 health_servicer: health.aio.HealthServicer, agent: MemberAgent | None) -> None:
        self.settings = settings
        self.core = core
        self.agent = agent
        self._server = server
        self._health = health_servicer
        self._stop_metrics: Callable[[], None] | None = None

    async def start(self) -> None:
        """Accept calls at once (health says NOT_SERVING), warm up, then SERVING and join the router."""
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        await self.core.start()
        ep = self.settings.dense_worker
        host = ep.bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        self._stop_metrics = self.core.metrics.serve(host, ep.metrics_port)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.agent is not None:
            self.agent.start()  # retries in the background while the router is down

    async def stop(self, grace: float | None) -> None:
        """Leave the router, refuse new calls, give running streams `grace` seconds, then fail
        what is left, flush the prefix cache and close the container."""
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
                  threads: int | None = None) -> tuple[WorkerServer, int]:
    """A dense worker bound to `bind` (port 0: any free port), not yet started; and its port.
    register: join the router at settings.router.address (as settings.dense_worker.id, reachable
    at settings.dense_worker.address, port 0 there meaning the bound port). threads: kernel
    threads of the step (default: every CPU, see moetier/engine.py)."""
    core = WorkerCore(settings, threads=threads)
    try:
        # One server per port: without this gRPC sets SO_REUSEPORT, and a second server on the
        # same port would share it silently instead of failing to bind.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        dense_worker_pb2_grpc.add_DenseWorkerServicer_to_server(DenseWorkerServicer(core), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"dense worker: cannot bind {bind}")
    except BaseException:
        core.container.close()
        raise
    agent = None
    if register:
        ep = settings.dense_worker
        host, _, want = ep.address.rpartition(":")
        if want == "0":
            settings = settings.model_copy(update={"dense_worker": ep.model_copy(update={"address": f"{host}:{port}"})})
        agent = MemberAgent.from_settings(settings, "dense_worker", model_id=core.model_id,
                                          load=lambda: convert.load_to_pb(core.load()))
    return WorkerServer(settings, core, server, health_servicer, agent), port


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the worker on settings.dense_worker.bind until SIGINT or SIGTERM, then stop gracefully.
    Joins the router when settings.router.address is set (an empty address: standalone)."""
    server, port = create_server(settings, settings.dense_worker.bind, register=bool(settings.router.address))
    await server.start()
    log.info("dense worker serving on %s (port %d)", settings.dense_worker.bind, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("dense worker stopping (grace %.1f s)", grace_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop(grace_s)
    log.info("dense worker stopped")
