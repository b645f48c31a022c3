"""The expert map's backend in process: /dashboard (a self-contained page), /dashboard/heat
(stores found through the router's ClusterStatus, Heat called with a deadline, graceful
when none answers) and /dashboard/stats (windowed tokens/s, TTFT and hit rate)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import pytest
from helpers_gateway import MODEL, FakeRouter, gateway_settings, make_model_dir
from prometheus_client import CollectorRegistry, Counter, start_http_server

from moetier.rpc.tensors import to_pb
from moetier.rpc.v1 import expert_store_pb2, expert_store_pb2_grpc, router_pb2, router_pb2_grpc
from services.gateway.app import create_app
from services.gateway.dashboard_stats import Buckets, LiveStats
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(60)

LAYERS, E = [1, 2, 3], 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


class Router(FakeRouter):
    """The gateway tests' fake router, listing expert stores with their addresses."""

    stores: list[tuple[str, str, str]]  # (member id, address, metrics address)

    async def ClusterStatus(self, request: router_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> router_pb2.ClusterStatusResponse:
        members = [router_pb2.Member(kind=router_pb2.MEMBER_KIND_DENSE_WORKER, member_id="worker-0",
                                     address="127.0.0.1:1")]
        members += [router_pb2.Member(kind=router_pb2.MEMBER_KIND_EXPERT_STORE, member_id=i, address=a,
                                      metrics_address=m) for i, a, m in self.stores]
        return router_pb2.ClusterStatusResponse(members=members, queued=0, queue_capacity=8)


class Store(expert_store_pb2_grpc.ExpertStoreServicer):
    """Heat from arrays the test sets; `hang` makes it miss every deadline."""

    def __init__(self) -> None:
        self.counts = np.zeros((len(LAYERS), E), np.uint32)
        self.tier = np.ones((len(LAYERS), E), np.uint8)
        self.recent = np.zeros((len(LAYERS), E), np.uint8)
        self.step = 0
        self.hang = False
        self.calls = 0

    async def Heat(self, request: expert_store_pb2.HeatRequest,
                   context: grpc.aio.ServicerContext) -> expert_store_pb2.HeatResponse:
        self.calls += 1
        if self.hang:
            await asyncio.sleep(30)
        return expert_store_pb2.HeatResponse(
            moe_layers=LAYERS, n_experts=E, counts=to_pb(self.counts), tier=to_pb(self.tier),
            recent=to_pb(self.recent), disks=["primary", "mirror0"], resident_bytes=3 << 20,
            budget_bytes=8 << 20, step=self.step)


@dataclass
class Cluster:
    client: httpx.AsyncClient
    router: Router
    store: Store
    store_address: str
    hits: Counter
    misses: Counter


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("models")))


@contextlib.asynccontextmanager
async def cluster(model: ServedModel, router_up: bool = True) -> AsyncIterator[Cluster]:
    """Fake router and fake store (gRPC, port 0), the store's /metrics, the app in process."""
    server = grpc.aio.server()
    router, store = Router(model.tokenizer), Store()
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    expert_store_pb2_grpc.add_ExpertStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    registry = CollectorRegistry()
    hits = Counter("moetier_expert_store_hits", "h", ["layer"], registry=registry)
    misses = Counter("moetier_expert_store_misses", "m", ["layer", "disk"], registry=registry)
    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    address = f"127.0.0.1:{port}"
    router.stores = [("store-0", address, f"127.0.0.1:{httpd.server_address[1]}")]
    app = create_app(gateway_settings(port if router_up else _closed_port()), model=model)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=10) as client:
                yield Cluster(client, router, store, address, hits, misses)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
        await server.stop(None)


def _closed_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_page_is_self_contained(model: ServedModel) -> None:
    async with cluster(model) as c:
        r = await c.client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    # Nothing fetched from elsewhere: no external script, style, font or image.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads something remote"
    assert not re.search(r"""@import|url\(\s*["']?(https?:)?//""", html)
    assert "<script src" not in html
    # It polls the two endpoints of this module, relative to where it is served.
    assert '"dashboard/heat"' in html and '"dashboard/stats"' in html


async def test_heat_from_the_stores_the_router_lists(model: ServedModel) -> None:
    async with cluster(model) as c:
        c.store.counts[1, 3] = 7
        c.store.tier[0, :3] = 0
        c.store.tier[2, 5] = 2
        c.store.recent[1, 3] = 1
        c.store.step = 42
        r = await c.client.get("/dashboard/heat")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["message"] is None and body["model"] == MODEL
    (s,) = body["stores"]
    assert s["id"] == "store-0" and s["address"] == c.store_address and s["error"] is None
    assert s["layers"] == LAYERS and s["n_experts"] == E and s["step"] == 42
    assert s["disks"] == ["primary", "mirror0"]
    assert (s["resident_bytes"], s["budget_bytes"]) == (3 << 20, 8 << 20)
    assert len(s["counts"]) == len(s["tier"]) == len(s["recent"]) == len(LAYERS) * E
    assert s["counts"][1 * E + 3] == 7 and sum(s["counts"]) == 7
    assert s["recent"][1 * E + 3] == 1 and sum(s["recent"]) == 1
    assert s["tier"][:3] == [0, 0, 0] and s["tier"][2 * E + 5] == 2
    # RAM, primary only, mirror0 only.
    assert s["experts_per_tier"] == [3, len(LAYERS) * E - 4, 1]


async def test_heat_when_no_store_answers(model: ServedModel) -> None:
    async with cluster(model) as c:
        c.router.stores = []
        r = await c.client.get("/dashboard/heat")
        assert r.status_code == 200
        assert r.json()["status"] == "no_stores" and "no expert store" in r.json()["message"]

        # A store that hangs: the deadline ends the call and the answer says which store.
        c.router.stores = [("store-0", c.store_address, "")]
        c.store.hang = True
        await asyncio.sleep(1.1)  # past the cached store list
        t0 = asyncio.get_running_loop().time()
        r = await c.client.get("/dashboard/heat")
        assert asyncio.get_running_loop().time() - t0 < 5
        body = r.json()
        assert body["status"] == "stores_unreachable" and "store-0" in body["message"], body
        assert body["stores"][0]["error"] and body["stores"][0]["counts"] == []

        # A listed store nobody serves.
        c.router.stores = [("store-0", c.store_address, ""), ("store-1", f"127.0.0.1:{_closed_port()}", "")]
        c.store.hang = False
        await asyncio.sleep(1.1)
        body = (await c.client.get("/dashboard/heat")).json()
        assert body["status"] == "partial" and "store-1" in body["message"], body
        assert [s["error"] is None for s in body["stores"]] == [True, False]


async def test_heat_when_the_router_is_down(model: ServedModel) -> None:
    async with cluster(model, router_up=False) as c:
        r = await c.client.get("/dashboard/heat")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "router_unreachable" and "router" in body["message"] and body["stores"] == []
        stats = (await c.client.get("/dashboard/stats")).json()
        assert stats["hit_rate"] is None and stats["generated_tokens"] == 0


async def test_stats_tokens_ttft_and_hit_rate(model: ServedModel) -> None:
    async with cluster(model) as c:
        c.hits.labels("1").inc(30)
        c.misses.labels("1", "primary").inc(10)
        first = (await c.client.get("/dashboard/stats")).json()
        assert first["hit_rate_total"] == pytest.approx(0.75)
        assert first["ttft_s"]["count"] == 0 and first["ttft_s"]["p50"] is None
        tokens = 0
        for _ in range(3):
            r = await c.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            tokens = r.json()["usage"]["completion_tokens"]
        c.hits.labels("2").inc(10)
        c.misses.labels("2", "mirror0").inc(30)
        await asyncio.sleep(0.05)
        s = (await c.client.get("/dashboard/stats")).json()
    assert tokens > 1 and s["generated_tokens"] == 3 * tokens
    assert s["tokens_per_s"] > 0 and s["window_s"] > 0
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["over"] == "window" and s["ttft_s"]["p50"] > 0
    assert s["inter_token_s"]["count"] == 3 * (tokens - 1)
    # Over the window: 10 hits, 30 misses; since start: 40 of 80.
    assert s["hit_rate"] == pytest.approx(0.25) and s["hit_rate_total"] == pytest.approx(0.5)
    assert s["running_requests"] == 0


def test_window_quantiles_match_histogram_quantile() -> None:
    b = Buckets((0.1, 0.2, 0.4, float("inf")), (0.0, 10.0, 20.0, 20.0), 4.0, 20.0)
    assert b.quantile(0.5) == pytest.approx(0.2)  # rank 10: the top of the second bucket
    assert b.quantile(0.25) == pytest.approx(0.15)  # rank 5: half-way through (0.1, 0.2]
    assert b.quantile(0.75) == pytest.approx(0.3)
    assert Buckets((1.0, float("inf")), (0.0, 5.0), 50.0, 5.0).quantile(0.5) == 1.0  # only +Inf: its lower bound
    assert Buckets((1.0, float("inf")), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None


def test_window_slides() -> None:
    now = [0.0]
    m = GatewayMetrics()
    live = LiveStats(m, window_s=10.0, clock=lambda: now[0])
    live.report(None)
    for t in range(1, 31):
        now[0] = float(t)
        m.generation_tokens.inc(5 if t <= 20 else 1)  # 5 tokens/s, then 1 token/s
        r = live.report((float(t), 0.0))
    assert r["window_s"] == pytest.approx(10.0, abs=1.0)
    assert r["tokens_per_s"] == pytest.approx(1.0, rel=0.15)
    assert r["hit_rate"] == 1.0
