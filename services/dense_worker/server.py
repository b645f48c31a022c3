"""The dense worker process: gRPC server (DenseWorker + grpc.health.v1), metrics endpoint,
router membership, lifecycle.

    server, port = create_server(settings, "127.0.0.1:0")
    await server.start()
    ...
    await server.stop(grace=5)
"""

from __future__ import annotations

import grpc

from moetier.cluster import MemberAgent
from moetier.errors import InvalidArgument
from moetier.rpc.errors import rpc_errors
from moetier.rpc.serving import ServiceServer, listen, new_server, run_until_signal, with_bound_port
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc, generate_pb2
from moetier.settings import Settings
from moetier.wake_latency import hold_wake_latency
from services.dense_worker import convert
from services.dense_worker.core import WorkerCore

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


class WorkerServer(ServiceServer[WorkerCore]):
    """The gRPC server plus what lives beside it: the core, health, /metrics, the router agent.
    Starting warms the kernels and checks the store while health says NOT_SERVING; stopping
    gives running streams the grace period, then fails what is left, flushes the prefix cache
    and closes the container."""

    def __init__(self, settings: Settings, core: WorkerCore, server: grpc.aio.Server,
                 agent: MemberAgent | None) -> None:
        super().__init__("dense worker", SERVICE_NAME, settings.dense_worker, core, server, agent)


def create_server(settings: Settings, bind: str = "127.0.0.1:0", *, register: bool = False,
                  threads: int | None = None) -> tuple[WorkerServer, int]:
    """A dense worker bound to `bind` (port 0: any free port), not yet started; and its port.
    register: join the router at settings.router.address (as settings.dense_worker.id, reachable
    at settings.dense_worker.address, port 0 there meaning the bound port). threads: kernel
    threads of the step (default: every CPU, see moetier/engine.py)."""
    core = WorkerCore(settings, threads=threads)
    try:
        server = new_server()
        dense_worker_pb2_grpc.add_DenseWorkerServicer_to_server(DenseWorkerServicer(core), server)
        port = listen(server, bind, "dense worker")
    except BaseException:
        core.container.close()
        raise
    agent = None
    if register:
        settings = with_bound_port(settings, "dense_worker", port)
        agent = MemberAgent.from_settings(settings, "dense_worker", model_id=core.model_id,
                                          load=lambda: convert.load_to_pb(core.load()))
    return WorkerServer(settings, core, server, agent), port


async def serve(settings: Settings, grace_s: float = 5.0) -> None:
    """Run the worker on settings.dense_worker.bind until SIGINT or SIGTERM, then stop gracefully.
    Joins the router when settings.router.address is set (an empty address: standalone)."""
    server, port = create_server(settings, settings.dense_worker.bind, register=bool(settings.router.address))
    with hold_wake_latency(settings.kernels.max_wake_latency_us):
        await run_until_signal(server, port, grace_s)
