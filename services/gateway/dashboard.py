"""The live expert map: a self-contained page at /dashboard (no CDN, no build step) and
the two JSON endpoints it polls.

  GET /dashboard        the page (services/gateway/dashboard.html)
  GET /dashboard/heat   every store's Heat snapshot (per-expert counts, tier, recently routed)
  GET /dashboard/stats  tokens/s, TTFT, inter-token latency and hit rate over a sliding window

Both JSON endpoints answer 200 with a `status` and a `message` when the router or the
stores cannot be reached, so the page can say so instead of failing.
"""

from __future__ import annotations

import time
from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from moetier.errors import MoetierError
from services.gateway.dashboard_sources import ClusterSource, StoreRef
from services.gateway.dashboard_stats import LiveStats
from services.gateway.metrics import GatewayMetrics

STORES_TTL_S = 1.0  # the page polls heat and stats together: one ClusterStatus serves both


@cache
def page() -> str:
    return files("services.gateway").joinpath("dashboard.html").read_text(encoding="utf-8")


class Dashboard:
    """One per app (app.state.dashboard); `open()` and `close()` run in the app's lifespan."""

    def __init__(self, router_address: str, metrics: GatewayMetrics, model_name: str,
                 timeout_s: float = 1.0) -> None:
        self.router_address = router_address
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.stats = LiveStats(metrics)
        self.source: ClusterSource | None = None
        self._stores: tuple[float, list[StoreRef]] | None = None

    def open(self) -> None:
        self.source = ClusterSource(self.router_address, self.timeout_s)

    async def close(self) -> None:
        if self.source is not None:
            await self.source.close()
            self.source = None

    async def stores(self) -> list[StoreRef]:
        if self.source is None:
            raise MoetierError("the gateway is not started")
        now = time.monotonic()
        if self._stores is None or now - self._stores[0] > STORES_TTL_S:
            self._stores = (now, await self.source.stores())
        return self._stores[1]

    async def heat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model_name, "status": "ok", "message": None, "stores": []}
        try:
            stores = await self.stores()
        except MoetierError as e:
            return {**out, "status": "router_unreachable", "message": str(e)}
        if not stores:
            return {**out, "status": "no_stores", "message": "no expert store is registered with the router"}
        assert self.source is not None
        heats = await self.source.heats(stores)
        out["stores"] = [h.to_dict() for h in heats]
        failed = [h.error for h in heats if h.error]
        if len(failed) == len(heats):
            out.update(status="stores_unreachable", message="; ".join(f for f in failed if f))
        elif failed:
            out.update(status="partial", message="; ".join(f for f in failed if f))
        return out

    async def live(self) -> dict[str, Any]:
        hits_misses = None
        try:
            stores = await self.stores()
            if self.source is not None:
                hits_misses = await self.source.hits_misses(stores)
        except MoetierError:
            pass  # tokens/s and TTFT are the gateway's own; hit rate stays unknown
        return self.stats.report(hits_misses)


router = APIRouter()


def _dashboard(request: Request) -> Dashboard:
    d: Dashboard = request.app.state.dashboard
    return d


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    return HTMLResponse(page())


@router.get("/dashboard/heat", include_in_schema=False)
async def dashboard_heat(request: Request) -> JSONResponse:
    return JSONResponse(await _dashboard(request).heat(), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/stats", include_in_schema=False)
async def dashboard_stats(request: Request) -> JSONResponse:
    return JSONResponse(await _dashboard(request).live(), headers={"Cache-Control": "no-store"})
