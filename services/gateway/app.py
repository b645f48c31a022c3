"""The gateway app factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI

from moetier.settings import Settings
from services.gateway.anthropic import router as anthropic_router
from services.gateway.api import Gateway, router
from services.gateway.dashboard import Dashboard
from services.gateway.dashboard import router as dashboard_router
from services.gateway.errors import install_handlers
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import APIKeyAuth, BodyLimit, StatusMetrics
from services.gateway.model import ServedModel, default_model_dir
from services.gateway.responses import router as responses_router
from services.gateway.router_client import RouterClient

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, model: ServedModel | None = None) -> FastAPI:
    """The OpenAI-compatible app. `model`: the served model (default: read from
    `model.path`, named `model.name` or after its directory). The router connection
    (`router.address`) is opened and closed by the app's lifespan."""
    served = model or ServedModel.from_dir(default_model_dir(settings), settings.model.name,
                                           settings.gateway.tool_parser)
    gw = Gateway(settings=settings, model=served, metrics=GatewayMetrics())
    dashboard = Dashboard(settings.router.address, gw.metrics, served.name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.router = RouterClient(settings.router.address)
        dashboard.open()
        log.info("serving model %s (context %d tokens) through the router at %s", served.name,
                 gw.context_limit, settings.router.address)
        try:
            yield
        finally:
            await gw.router.close()
            gw.router = None
            await dashboard.close()
            log.info("gateway stopped")

    app = FastAPI(title="moetier gateway", version=version("moetier"), lifespan=lifespan,
                  description="OpenAI-compatible API of a moetier cluster.")
    app.state.gateway = gw
    app.state.dashboard = dashboard
    install_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(dashboard_router)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(BodyLimit, max_bytes=settings.gateway.max_body_bytes)
    app.add_middleware(APIKeyAuth, api_key=settings.gateway.api_key)
    app.add_middleware(StatusMetrics, metrics=gw.metrics)
    return app
