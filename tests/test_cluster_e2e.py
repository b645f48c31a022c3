"""The whole cluster in one process: gateway (ASGI, with its lifespan) -> router -> dense worker
-> expert store, each a real server on port 0, over the tiny MLA synth container.

A chat completion at temperature 0 is exactly what `moetier generate` computes in-process; a
conversation's second turn reuses the first turn's KV on the worker (and is routed back to
it); a client that hangs up mid-stream frees its KV on the worker."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetier.convert import synth
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.settings import Settings, load_settings
from services.dense_worker.server import WorkerServer
from services.dense_worker.server import create_server as create_worker
from services.expert_store.server import StoreServer
from services.expert_store.server import create_server as create_store
from services.gateway.app import create_app
from services.gateway.model import ServedModel
from services.router.server import RouterServer
from services.router.server import create_server as create_router

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny-mla"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("e2e") / MODEL, 0)


@dataclass
class Up:
    client: httpx.AsyncClient
    router: RouterServer
    worker: WorkerServer
    store: StoreServer
    served: ServedModel

    def worker_metric(self, name: str, **labels: str) -> float:
        self.worker.core.refresh_metrics()
        text = generate_latest(self.worker.core.metrics.registry).decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())


INFERENCE = {"max_batch_size": 4, "max_waiting": 8, "prefill_chunk": 32, "expert_timeout_s": 5.0}


def settings_for(model: Path, tmp: Path, router_port: int = 0, store_port: int = 0, *,
                 expert_cache: str = "100%", inference: dict[str, Any] = INFERENCE) -> Settings:
    return load_settings(overrides={
        "model": {"path": str(model), "expert_cache": expert_cache},
        "cache": {"policy": "lru"},
        "data_dir": str(tmp / "data"),
        "router": {"bind": "127.0.0.1:0", "address": f"127.0.0.1:{router_port}", "metrics_port": 0, "id": "router"},
        "expert_store": {"bind": "127.0.0.1:0", "address": f"127.0.0.1:{store_port}", "metrics_port": 0,
                         "id": "store-0"},
        "dense_worker": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "worker-0"},
        "inference": inference,
        "heartbeat_interval_s": 0.1,
    }, environ={})


@asynccontextmanager
async def up(model: Path, tmp: Path, *, expert_cache: str = "100%",
             inference: dict[str, Any] = INFERENCE) -> AsyncIterator[Up]:
    """Router, expert store, dense worker and gateway in this process (settings: `settings_for`)."""
    def settings_at(router_port: int = 0, store_port: int = 0) -> Settings:
        return settings_for(model, tmp, router_port, store_port, expert_cache=expert_cache, inference=inference)

    router, rport = create_router(settings_at(), "127.0.0.1:0")
    await router.start()
    store, sport = create_store(settings_at(rport), "127.0.0.1:0", threads=1)
    await store.start()
    settings = settings_at(rport, sport)
    worker, _ = create_worker(settings, "127.0.0.1:0", register=True)
    await worker.start()
    served = ServedModel.from_dir(model, MODEL)
    # uvicorn on a real socket (not httpx's ASGI transport, which buffers whole responses), so
    # a client hanging up mid-stream is a real disconnect
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    gateway = uvicorn.Server(uvicorn.Config(create_app(settings, model=served), log_level="warning", lifespan="on"))
    serving = asyncio.get_running_loop().create_task(gateway.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 5
        while not (worker.agent and worker.agent.registered.is_set() and gateway.started):
            assert time.monotonic() < deadline and not serving.done(), "the cluster did not come up"
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield Up(client, router, worker, store, served)
    finally:
        gateway.should_exit = True
        await serving
        sock.close()
        await worker.stop(0)
        await store.stop(0)
        await router.stop(0)


def expected_reply(model: Path, served: ServedModel, messages: list[dict[str, str]], max_tokens: int) -> str:
    tok = served.tokenizer
    assert tok.chat_template is not None
    ids = tok.encode(tok.chat_template.render(messages), add_special_tokens=False)
    with Engine.open(model, budget="100%") as engine:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=tok.eos_token_ids,
                                ignore_eos=True)
        return tok.decode([g.token for g in engine.generate(ids, params)])


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0,
                                                        "max_tokens": 24, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_chat_equals_in_process_and_conversation_reuses_kv(model: Path, tmp_path: Path) -> None:
    turn1 = [{"role": "user", "content": "Tell me about the disks and the experts of this machine."}]
    async with up(model, tmp_path) as c:
        r1 = await chat(c.client, turn1)
        reply = r1["choices"][0]["message"]["content"]
        assert reply == expected_reply(model, c.served, turn1, 24)
        # streaming gives the same text
        async with c.client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": turn1, "temperature": 0, "max_tokens": 24, "stream": True}) as s:
            pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      async for line in s.aiter_lines() if line.startswith("data: {") and '"choices":[{' in line]
        assert "".join(pieces) == reply
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        before = c.worker_metric("moetier_dense_worker_prefix_cache_hit_tokens_total")
        r2 = await chat(c.client, turn2)
        assert r2["choices"][0]["message"]["content"] == expected_reply(model, c.served, turn2, 24)
        assert c.worker_metric("moetier_dense_worker_prefix_cache_hit_tokens_total") - before >= 16


async def test_client_hanging_up_frees_the_workers_kv(model: Path, tmp_path: Path) -> None:
    async with up(model, tmp_path) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 500,
                "temperature": 0.9, "seed": 9}
        # seeded: left alone, this generation runs to max_tokens (no end-of-text on the way), so
        # whatever ends it early below is the hang-up
        full = (await c.client.post("/v1/chat/completions", json=body)).json()
        assert full["choices"][0]["finish_reason"] == "length"
        body["stream"] = True
        async with c.client.stream("POST", "/v1/chat/completions", json=body) as s:
            async for line in s.aiter_lines():
                if '"content"' in line:
                    break  # hang up after the first token
        deadline = time.monotonic() + 5
        while c.worker_metric("moetier_dense_worker_kv_cache_bytes") != 0 or \
                c.worker_metric("moetier_dense_worker_running_requests") != 0:
            assert time.monotonic() < deadline, "the worker kept the sequence"
            await asyncio.sleep(0.05)
        assert c.worker_metric("moetier_dense_worker_finished_requests_total", finish_reason="cancelled") == 1
        assert c.worker_metric("moetier_dense_worker_finished_requests_total", finish_reason="length") == 1
