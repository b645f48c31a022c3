"""`moetier gateway`: the app under uvicorn, with a graceful shutdown on SIGINT/SIGTERM
(uvicorn stops accepting, lets running requests finish for a while, then runs the app's
lifespan shutdown, which closes the router channel)."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from moetier.errors import InvalidArgument
from moetier.rpc.serving import bind_socket
from moetier.settings import Settings
from services.gateway.app import create_app

log = logging.getLogger(__name__)

GRACE_S = 10


def parse_bind(bind: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"gateway.bind {bind!r}: expected host:port")
    return host.strip("[]"), int(port)


def serve(settings: Settings) -> None:
    host, port = parse_bind(settings.gateway.bind)
    # Bound here, before the app starts: a taken port is one line naming it (uvicorn would log
    # the failure after the app's start-up and exit 3).
    sock = bind_socket(settings.gateway.bind, "gateway")
    try:
        app = create_app(settings)
        config = uvicorn.Config(app, host=host, port=port, lifespan="on", log_config=None, access_log=False,
                                timeout_graceful_shutdown=GRACE_S)
        log.info("gateway listening on http://%s:%d%s", host, port,
                 " (API key required on /v1/*)" if settings.gateway.api_key else "")
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    finally:
        sock.close()
