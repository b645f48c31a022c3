"""What every gRPC service process does the same way (router, dense worker, expert store):
one server per port, grpc.health.v1 beside the service, /metrics over HTTP, one start and
stop order, and running until SIGINT or SIGTERM.

    server = new_server()                                       # add the servicer to it, then
    port = listen(server, bind, "dense worker")                 # the bound port (bind port 0: any)
    settings = with_bound_port(settings, "dense_worker", port)  # address port 0 -> the bound port
    service = WorkerServer(...)                  # a ServiceServer: adds grpc.health.v1 to `server`
    await service.start()                        # NOT_SERVING, core started, /metrics, SERVING, agent
    await service.stop(grace=5)                  # agent stopped, calls drained, core and /metrics
    await run_until_signal(service, port, 5.0)   # start, wait for SIGINT or SIGTERM, stop
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import Generic, Literal, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from moetier.cluster import MemberAgent
from moetier.errors import InvalidArgument, Unavailable
from moetier.settings import Endpoint, Settings


class _Metrics(Protocol):
    @property
    def registry(self) -> CollectorRegistry: ...


class Core(Protocol):
    """A service's domain object: its metrics, and what starting and stopping it means."""

    @property
    def metrics(self) -> _Metrics: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


C = TypeVar("C", bound=Core)


def new_server(options: list[tuple[str, int]] | None = None) -> grpc.aio.Server:
    """A gRPC server that owns its port: without `grpc.so_reuseport` 0 gRPC sets SO_REUSEPORT, and
    a second server on the same port would share it silently instead of failing to bind."""
    return grpc.aio.server(options=[*(options or []), ("grpc.so_reuseport", 0)])


def _split(bind: str) -> tuple[str, int] | None:
    """'host:port' or '[v6]:port' -> (host, port); None for other forms (gRPC's `unix:` ones)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or bind.startswith("unix"):
        return None
    return host.strip("[]"), int(port)


def _bind_each(host: str, port: int) -> tuple[socket.socket | None, str]:
    """A TCP socket bound to host:port (SO_REUSEADDR, as gRPC and the HTTP servers set it: a
    TIME_WAIT leftover is no conflict), trying each address the host resolves to; else None and
    why not."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return None, f"cannot resolve {host!r} ({e.strerror})"
    why = ""
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            return sock, ""
        except OSError as e:
            sock.close()
            why = why or (e.strerror or str(e)).lower()
    return None, why


def bind_problem(bind: str) -> str | None:
    """Why nothing can listen on `bind` now (e.g. "address already in use"), or None when it
    can (or cannot be checked: port 0, a unix socket)."""
    hp = _split(bind)
    if hp is None or hp[1] == 0:
        return None
    sock, why = _bind_each(*hp)
    if sock is not None:
        sock.close()
        return None
    return why


def bind_socket(bind: str, what: str) -> socket.socket:
    """A TCP socket bound to `bind` (host:port), for a server that takes a socket (the gateway's
    uvicorn); Unavailable naming the address when that fails."""
    hp = _split(bind)
    if hp is None:
        raise InvalidArgument(f"{what}: bind address {bind!r}: expected host:port")
    sock, why = _bind_each(*hp)
    if sock is None:
        raise Unavailable(f"{what}: cannot listen on {bind}: {why}")
    return sock


def listen(server: grpc.aio.Server, bind: str, what: str) -> int:
    """Bind `server` to `bind` (host:port; port 0: any free port); the bound port. An address
    that cannot be bound is an Unavailable naming it and why, in one line: the address is tried
    with a plain socket first (the OS says why; gRPC only says that it failed, and logs its own
    error line), then gRPC binds it (this grpcio raises RuntimeError rather than returning 0)."""
    why = bind_problem(bind)
    if why is None:
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError:
            port = 0
        if port:
            return port
        why = "gRPC could not bind it (GRPC_VERBOSITY=debug says why)"
    raise Unavailable(f"{what}: cannot listen on {bind}: {why}")


def with_bound_port(settings: Settings, section: Literal["dense_worker", "expert_store"], port: int) -> Settings:
    """`settings` with the section's `address` (where others reach the service) given the bound
    port when it says port 0."""
    ep = getattr(settings, section)
    host, _, want = ep.address.rpartition(":")
    if want != "0":
        return settings
    return settings.model_copy(update={section: ep.model_copy(update={"address": f"{host}:{port}"})})


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str) -> Callable[[], None] | None:
    """Serve `registry` at http://host:port/metrics (port 0: not at all); returns the stopper.
    Unavailable naming the address when it cannot be bound."""
    if port == 0:
        return None
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise Unavailable(f"{what}: cannot serve /metrics on {host}:{port}: {(e.strerror or str(e)).lower()}") from None

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return stop


def metrics_host(bind: str) -> str:
    """/metrics listens on the host the service binds (all interfaces when that is empty)."""
    return bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"


class ServiceServer(Generic[C]):
    """The gRPC server plus what lives beside it: the core, grpc.health.v1 (overall and for
    `service`), /metrics, and the router agent (dense worker, expert store). Logs go to the
    logger of the module that defines the subclass, as the service's own lines."""

    def __init__(self, name: str, service: str, endpoint: Endpoint, core: C, server: grpc.aio.Server,
                 agent: MemberAgent | None = None) -> None:
        self.name = name  # for people: "dense worker"
        self.endpoint = endpoint
        self.core = core
        self.agent = agent
        self._services = ("", service)
        self._server = server
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._stop_metrics: Callable[[], None] | None = None
        self.log = logging.getLogger(type(self).__module__)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in self._services:
            await self._health.set(service, status)

    async def start(self) -> None:
        """Accept calls at once (health says NOT_SERVING), start the core (warm-up), serve
        /metrics, then SERVING and join the router. A /metrics port that is taken is refused
        before anything starts (not after a long warm-up)."""
        host, port = metrics_host(self.endpoint.bind), self.endpoint.metrics_port
        why = bind_problem(f"[{host}]:{port}")
        if why is not None:
            raise Unavailable(f"{self.name}: cannot serve /metrics on {host}:{port}: {why}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        await self.core.start()
        self._stop_metrics = serve_metrics(self.core.metrics.registry, host, port, self.name)
        if self._stop_metrics is not None:
            self.log.info("metrics on http://%s:%d/metrics", host, port)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.agent is not None:
            self.agent.start()  # retries in the background while the router is down

    async def stop(self, grace: float | None) -> None:
        """Leave the router, refuse new calls, give running ones `grace` seconds (then they are
        cancelled), stop the core and /metrics."""
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


async def run_until_signal(service: ServiceServer[C], port: int, grace_s: float) -> None:
    """Start `service`, serve until SIGINT or SIGTERM, then stop it with `grace_s` seconds for
    the calls in flight."""
    log = service.log
    try:
        await service.start()
    except BaseException:
        try:
            await service.stop(0)  # what did start (server, core) stops; the start's error is the one told
        except Exception:
            log.exception("%s: stopping after a failed start", service.name)
        raise
    log.info("%s serving on %s (port %d)", service.name, service.endpoint.bind, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("%s stopping (grace %.1f s)", service.name, grace_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await service.stop(grace_s)
    log.info("%s stopped", service.name)
