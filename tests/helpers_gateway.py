"""Test support for the gateway: a model directory with the project tokenizer, a scripted
fake Router servicer on an in-process gRPC server (port 0), the app in process (httpx
ASGITransport) or served by uvicorn on a free port from a background thread.

A script is a list of actions the fake router plays for one Generate call:
  Emit(token_ids, finish_reason)  one GenerateResponse
  Fail(code, message, retry_ms)   abort the call (with retry-after-ms trailing metadata)
  Hang()                          wait until the client cancels
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import uvicorn
from fastapi import FastAPI

from moetier.convert.tokenizer import tokenizer_files
from moetier.rpc.errors import RETRY_AFTER_KEY
from moetier.rpc.v1 import generate_pb2, router_pb2, router_pb2_grpc
from moetier.settings import Settings, load_settings
from moetier.text import TextTokenizer
from services.gateway.app import create_app
from services.gateway.model import ServedModel

MODEL = "tiny-chat"
MAX_POS = 256
REPLY = "Hello, world! héllo 日本語 😀"


def make_model_dir(root: Path, vocab_size: int = 1024) -> Path:
    """A container directory as far as the gateway reads it (JSON and tokenizer files)."""
    d = root / MODEL
    d.mkdir(parents=True, exist_ok=True)
    for name, data in tokenizer_files(vocab_size, MAX_POS).items():
        (d / name).write_bytes(data)
    (d / "config.json").write_text(json.dumps({"model_type": "tiny", "max_position_embeddings": 1024}))
    (d / "moetier.json").write_text(json.dumps({"format": "moetier-container", "format_version": 1,
                                                "model": {"max_position_embeddings": MAX_POS}}))
    return d


@dataclass
class Emit:
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Fail:
    code: grpc.StatusCode
    message: str = "refused"
    retry_ms: int | None = None


@dataclass
class Hang:
    pass


Script = list[Emit | Fail | Hang]


def reply_script(tok: TextTokenizer, text: str = REPLY, *, max_tokens: int = 1000, eos: bool = True) -> Script:
    """One token per message; ends with an eos token ("stop"), or "length" at max_tokens."""
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_ids[0]] if eos else [])
    finish = "stop" if eos else "length"
    if len(ids) > max_tokens:
        ids, finish = ids[:max_tokens], "length"
    return [Emit([i], finish if n == len(ids) - 1 else None) for n, i in enumerate(ids)]


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok
        self.reset()

    def reset(self) -> None:
        """Back to the default script and a healthy cluster, with nothing recorded."""
        tok = self.tok
        self.script: Callable[[generate_pb2.GenerateRequest], Script] = \
            lambda r: reply_script(tok, max_tokens=r.sampling.max_tokens)
        self.members: list[tuple[int, str]] = [(router_pb2.MEMBER_KIND_DENSE_WORKER, "worker-0"),
                                                (router_pb2.MEMBER_KIND_EXPERT_STORE, "store-0")]
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.started = threading.Event()  # a Generate call arrived
        self.cancelled = threading.Event()  # a Generate call was cancelled by its client

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        self.requests.append(request)
        self.started.set()
        first = True
        try:
            for action in self.script(request):
                if isinstance(action, Hang):
                    await asyncio.sleep(60)
                elif isinstance(action, Fail):
                    if action.retry_ms is not None:
                        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(action.retry_ms)),))
                    await context.abort(action.code, action.message)
                else:
                    yield generate_pb2.GenerateResponse(
                        tokens=[generate_pb2.GeneratedToken(token_id=t, logprob=-0.5,
                                                            top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=-0.5)]
                                                            [: request.sampling.top_logprobs])
                                for t in action.token_ids],
                        finish_reason=action.finish_reason,
                        prompt_tokens=len(request.prompt_ids) if first else 0,
                        queue_ns=2_000_000 if first else 0)
                    first = False
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError while it waits; GeneratorExit when the cancel lands between writes
            self.cancelled.set()
            raise

    async def ClusterStatus(self, request: router_pb2.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> router_pb2.ClusterStatusResponse:
        return router_pb2.ClusterStatusResponse(
            members=[router_pb2.Member(kind=k, member_id=n) for k, n in self.members],  # type: ignore[arg-type]
            queued=0, queue_capacity=8)


async def start_fake_router(tok: TextTokenizer) -> tuple[grpc.aio.Server, int, FakeRouter]:
    server = grpc.aio.server()
    fake = FakeRouter(tok)
    router_pb2_grpc.add_RouterServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, fake


def gateway_settings(router_port: int, **gateway: Any) -> Settings:
    return load_settings(overrides={
        "router": {"bind": "127.0.0.1:0", "address": f"127.0.0.1:{router_port}", "metrics_port": 0, "id": "router"},
        "gateway": gateway,
        "inference": {"max_seq_len": 4096},
    }, environ={})


@dataclass
class InProcess:
    client: httpx.AsyncClient
    fake: FakeRouter
    app: FastAPI
    model: ServedModel


@contextlib.asynccontextmanager
async def in_process(model: ServedModel, router_port: int | None = None, **gateway: Any) -> AsyncIterator[InProcess]:
    """The app with its lifespan, in this event loop, behind httpx's ASGI transport."""
    server, port, fake = await start_fake_router(model.tokenizer)
    app = create_app(gateway_settings(router_port or port, **gateway), model=model)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=10) as client:
                yield InProcess(client, fake, app, model)
    finally:
        await server.stop(None)


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    fake: FakeRouter
    loop: asyncio.AbstractEventLoop


@contextlib.contextmanager
def served(model: ServedModel, **gateway: Any) -> Iterator[Served]:
    """The fake router and the gateway under uvicorn on a free port, in their own thread
    and event loop, so synchronous clients (openai, schemathesis) can call them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        server, rport, fake = await start_fake_router(model.tokenizer)
        app = create_app(gateway_settings(rport, **gateway), model=model)
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        box.update(fake=fake, uv=uv, loop=asyncio.get_running_loop())
        task = asyncio.create_task(uv.serve(sockets=[sock]))
        while not uv.started and not task.done():
            await asyncio.sleep(0.01)
        ready.set()
        await task
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(20), "gateway did not start"
    try:
        yield Served(f"http://127.0.0.1:{port}", box["fake"], box["loop"])
    finally:
        box["uv"].should_exit = True
        thread.join(10)
        sock.close()


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body: JSON objects, and the string "[DONE]"."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll pred while letting this event loop (and the servers in it) run."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll pred from a thread whose loop serves nothing (servers run in another thread)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()
