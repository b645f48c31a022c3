"""The gateway in process (httpx ASGI transport) in front of a scripted fake router:
OpenAI body and stream formats, the error table, the text layer through the API, health
and metrics."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers_gateway import (
    MAX_POS,
    MODEL,
    REPLY,
    Emit,
    Fail,
    Hang,
    InProcess,
    in_process,
    make_model_dir,
    reply_script,
    sse_events,
    until,
)

from moetier.rpc.v1 import generate_pb2
from moetier.settings import GatewaySection
from moetier.text import ChatTemplate
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("models")))


@pytest.fixture
async def gw(model: ServedModel) -> AsyncIterator[InProcess]:
    async with in_process(model) as g:
        yield g


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    assert body["error"]["message"]
    err: dict[str, Any] = body["error"]
    return err


# ---- bodies ----------------------------------------------------------------------------------


async def test_chat_completion_body(gw: InProcess, model: ServedModel) -> None:
    r = await gw.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    b = r.json()
    assert list(b) == ["id", "object", "created", "model", "choices", "usage"]
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion" and b["model"] == MODEL
    assert isinstance(b["created"], int)
    assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                             "logprobs": None, "finish_reason": "stop"}]
    tok = model.tokenizer
    req = gw.fake.requests[0]
    prompt = tok.chat_template.render(CHAT["messages"]) if tok.chat_template else ""
    assert list(req.prompt_ids) == tok.encode(prompt, add_special_tokens=False)
    completion = len(tok.encode(REPLY, add_special_tokens=False)) + 1  # the eos token counts, unseen
    p = len(req.prompt_ids)
    assert b["usage"] == {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    s = req.sampling
    assert s.max_tokens == MAX_POS - p  # the rest of the context
    assert tuple(s.stop_token_ids) == tok.eos_token_ids
    assert (s.temperature, s.top_p, s.top_k, s.HasField("seed")) == (1.0, 1.0, 0, False)
    assert req.request_id == b["id"]


async def test_sampling_params_from_the_request(gw: InProcess) -> None:
    body = {**CHAT, "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5, "top_k": 3,
            "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -1, "stop": "zzz", "user": "u"}
    r = await gw.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    s = gw.fake.requests[0].sampling
    assert s == generate_pb2.SamplingParams(temperature=0, top_p=0.5, top_k=3, seed=42, presence_penalty=0.5,
                                            frequency_penalty=-1, max_tokens=7, stop_token_ids=s.stop_token_ids)
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_default_temperature_applies_where_a_request_sets_none(model: ServedModel) -> None:
    """gateway.default_temperature (here greedy) is the temperature of a request of any API that
    sets none; one that sets it keeps its own."""
    bodies = [("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "Once upon"}),
              ("/v1/responses", {"model": MODEL, "input": "Hi"}),
              ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})]
    async with in_process(model, default_temperature=0.0) as g:
        for path, body in bodies:
            for extra, want in (({}, 0.0), ({"temperature": 0.7}, 0.7)):
                r = await g.client.post(path, json={**body, **extra})
                assert r.status_code == 200, (path, r.text)
                assert g.fake.requests[-1].sampling.temperature == pytest.approx(want), (path, extra)


async def test_chat_stream_format_with_usage(gw: InProcess) -> None:
    r = await gw.client.post("/v1/chat/completions",
                             json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL and c["id"].startswith("chatcmpl-")
        assert "usage" in c
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]]
    assert "".join(pieces) == REPLY
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters split across tokens


async def test_stream_without_usage_has_no_usage_key(gw: InProcess) -> None:
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completion_body_and_stream(gw: InProcess, model: ServedModel) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 3}
    r = await gw.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "text_completion" and b["id"].startswith("cmpl-")
    ids = model.tokenizer.encode(REPLY, add_special_tokens=False)[:3]
    assert b["choices"] == [{"index": 0, "text": model.tokenizer.decode(ids), "logprobs": None,
                             "finish_reason": "length"}]
    assert b["usage"]["completion_tokens"] == 3
    assert list(gw.fake.requests[0].prompt_ids) == model.tokenizer.encode("Once upon")

    r = await gw.client.post("/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] > 3
    texts = [c["choices"][0]["text"] for c in events[:-2]]
    assert "".join(texts) == model.tokenizer.decode(ids)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in events[:-1])


async def test_completion_token_prompt_echo_and_default_max_tokens(gw: InProcess, model: ServedModel) -> None:
    ids = model.tokenizer.encode("Hello there")
    r = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "echo": True})
    assert r.status_code == 200, r.text
    first16 = model.tokenizer.decode(model.tokenizer.encode(REPLY, add_special_tokens=False)[:16])
    assert r.json()["choices"][0]["text"] == "Hello there" + first16
    assert list(gw.fake.requests[0].prompt_ids) == ids
    assert gw.fake.requests[0].sampling.max_tokens == 16  # OpenAI's default for completions


async def test_null_max_tokens_is_the_documented_default(gw: InProcess) -> None:
    """docs/gateway.md: completions default to 16 tokens (OpenAI's default), chat completions to the
    rest of the context; an explicit null is the default, as an absent field."""
    for body in ({"model": MODEL, "prompt": "Once upon"}, {"model": MODEL, "prompt": "Once upon", "max_tokens": None}):
        r = await gw.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert gw.fake.requests[-1].sampling.max_tokens == 16, body
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}, {"max_tokens": None,
                                                                            "max_completion_tokens": None}):
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 200, r.text
        req = gw.fake.requests[-1]
        assert req.sampling.max_tokens == MAX_POS - len(req.prompt_ids), extra  # the rest of the context


async def test_logprobs(gw: InProcess, model: ServedModel) -> None:
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1})
    s = gw.fake.requests[0].sampling
    assert s.logprobs and s.top_logprobs == 1
    content = r.json()["choices"][0]["logprobs"]["content"]
    tok = model.tokenizer
    assert len(content) == len(tok.encode(REPLY, add_special_tokens=False)) + 1
    assert b"".join(bytes(c["bytes"]) for c in content[:-1]) == REPLY.encode()
    assert content[0]["logprob"] == -0.5 and len(content[0]["top_logprobs"]) == 1
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}

    r = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"] == [-0.5, -0.5] and lp["text_offset"][0] == 0


async def test_models(gw: InProcess) -> None:
    r = await gw.client.get("/v1/models")
    assert r.json() == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": r.json()["data"][0]["created"],
                                                    "owned_by": "moetier", "max_model_len": MAX_POS}]}


# ---- text through the API ------------------------------------------------------------------


async def test_stop_string_across_tokens_ends_and_cancels_generation(gw: InProcess, model: ServedModel) -> None:
    tok = model.tokenizer
    gw.fake.script = lambda r: [*(Emit([i]) for i in tok.encode(REPLY, add_special_tokens=False)), Hang()]
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stop": ["ld! h", "never"]})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello, wor" and choice["finish_reason"] == "stop"
    assert await until(gw.fake.cancelled.is_set)  # the rest of the generation was cancelled

    gw.fake.reset()
    gw.fake.script = lambda r: [*(Emit([i]) for i in tok.encode(REPLY, add_special_tokens=False)), Hang()]
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stop": "日本", "stream": True})
    chunks = sse_events(r.text)[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hello, world! héllo " and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_partial_stop_match_at_end_is_returned(gw: InProcess) -> None:
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stop": ["😀!"]})
    assert r.json()["choices"][0]["message"]["content"] == REPLY


# ---- errors ----------------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("bad json", {"content": b'{"model": "tiny-chat", "messages": [', "headers": {"content-type": "application/json"}},
     400, None),
    ("wrong content type", {"content": json.dumps(CHAT).encode(), "headers": {"content-type": "text/plain"}}, 400, None),
    ("messages not a list", {"json": {**CHAT, "messages": "hi"}}, 400, "messages"),
    ("unknown role", {"json": {**CHAT, "messages": [{"role": "tool", "content": "x"}]}}, 400, "messages"),
    ("temperature a string", {"json": {**CHAT, "temperature": "hot"}}, 400, "temperature"),
    ("temperature too high", {"json": {**CHAT, "temperature": 2.5}}, 400, "temperature"),
    ("negative max_tokens", {"json": {**CHAT, "max_tokens": -1}}, 400, "max_tokens"),
    ("five stops", {"json": {**CHAT, "stop": ["a", "b", "c", "d", "e"]}}, 400, "stop"),
    ("n=2", {"json": {**CHAT, "n": 2}}, 400, "n"),
    ("missing model", {"json": {"messages": CHAT["messages"]}}, 400, "model"),
    ("unknown model", {"json": {**CHAT, "model": "gpt-4"}}, 404, "model"),
    ("over the context", {"json": {**CHAT, "max_tokens": MAX_POS}}, 400, "messages"),
    ("prompt alone over the context", {"json": {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}},
     400, "messages"),
    ("10 MB body", {"content": b"{" + b" " * 10_000_000 + b"}", "headers": {"content-type": "application/json"}},
     413, None),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_requests(gw: InProcess, case: tuple[str, dict[str, Any], int, str | None]) -> None:
    name, kwargs, status, param = case
    err = _error(await gw.client.post("/v1/chat/completions", **kwargs), status)
    assert err["param"] == param
    assert not gw.fake.requests  # nothing reached the router
    if name.endswith("over the context"):
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length is 256 tokens (inference.max_seq_len=4096, the model's " \
               "max_position_embeddings=256)" in err["message"]
    if name == "over the context":
        assert "256 for the completion" in err["message"]


async def test_chunked_body_over_the_limit(gw: InProcess) -> None:
    limit = GatewaySection().max_body_bytes

    async def body() -> AsyncIterator[bytes]:
        for _ in range(limit // 100_000 + 2):
            yield b" " * 100_000

    err = _error(await gw.client.post("/v1/chat/completions", content=body(),
                                      headers={"content-type": "application/json"}), 413)
    assert f"{limit} bytes" in err["message"]


async def test_completion_errors(gw: InProcess) -> None:
    _error(await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": [10**6]}), 400)
    _error(await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400)
    _error(await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400)
    _error(await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400)
    _error(await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream_options": {}}), 400)
    assert not gw.fake.requests


async def test_unknown_path_and_method(gw: InProcess) -> None:
    _error(await gw.client.get("/v1/nothing"), 404)
    _error(await gw.client.get("/v1/chat/completions"), 405)


async def test_api_key(model: ServedModel) -> None:
    async with in_process(model, api_key="sekrit") as g:
        assert _error(await g.client.get("/v1/models"), 401)["code"] == "invalid_api_key"
        r = await g.client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
        assert "Incorrect API key" in _error(r, 401)["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        # checked before the body is even parsed
        _error(await g.client.post("/v1/chat/completions", content=b"{", headers={"Authorization": "Basic x"}), 401)
        ok = {"Authorization": "Bearer sekrit"}
        assert (await g.client.get("/v1/models", headers=ok)).status_code == 200
        assert (await g.client.post("/v1/chat/completions", json=CHAT, headers=ok)).status_code == 200
        assert (await g.client.get("/health")).status_code == 200  # only /v1/* is protected
        assert (await g.client.get("/metrics")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_resource_exhausted_is_429_with_retry_after(gw: InProcess, stream: bool) -> None:
    gw.fake.script = lambda r: [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_ms=2500)]
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    err = _error(r, 429)
    assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error" and "queue full" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_no_worker_is_503(gw: InProcess, stream: bool) -> None:
    gw.fake.script = lambda r: [Fail(grpc.StatusCode.UNAVAILABLE, "no dense worker serves")]
    err = _error(await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream}), 503)
    assert "no dense worker" in err["message"]


async def test_router_unreachable(model: ServedModel) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with in_process(model, router_port=port, request_timeout_s=5) as g:
        _error(await g.client.post("/v1/chat/completions", json=CHAT), 503)
        r = await g.client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"


async def test_health_follows_cluster_status(gw: InProcess) -> None:
    r = await gw.client.get("/health")
    assert r.status_code == 200 and r.json()["dense_workers"] == ["worker-0"]
    gw.fake.members = gw.fake.members[1:]  # only the expert store is left
    r = await gw.client.get("/health")
    assert r.status_code == 503 and "no dense worker" in r.json()["reason"]
    gw.fake.members = []
    assert (await gw.client.get("/health")).status_code == 503


async def test_failure_mid_stream_is_an_error_chunk_then_done(gw: InProcess) -> None:
    gw.fake.script = lambda r: [Emit([40]), Emit([41]), Fail(grpc.StatusCode.UNAVAILABLE, "worker died")]
    r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert set(events[-2]) == {"error"} and set(events[-2]["error"]) == ENVELOPE_KEYS
    assert "worker died" in events[-2]["error"]["message"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"

    r = await gw.client.post("/v1/chat/completions", json=CHAT)  # without streaming: a plain 503
    _error(r, 503)


async def test_stream_that_ends_without_finish_is_an_error(gw: InProcess) -> None:
    gw.fake.script = lambda r: [Emit([40])]
    events = sse_events((await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text)
    assert "error" in events[-2] and events[-1] == "[DONE]"


async def test_template_rejection_is_400(gw: InProcess, model: ServedModel) -> None:
    original = model.tokenizer.chat_template
    object.__setattr__(model.tokenizer, "chat_template", ChatTemplate("{{ raise_exception('roles must alternate') }}"))
    try:
        err = _error(await gw.client.post("/v1/chat/completions", json=CHAT), 400)
        assert "roles must alternate" in err["message"]
    finally:
        object.__setattr__(model.tokenizer, "chat_template", original)


# ---- metrics ---------------------------------------------------------------------------------


async def test_metrics(gw: InProcess) -> None:
    await gw.client.post("/v1/chat/completions", json=CHAT)
    await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 2})
    await gw.client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    text = (await gw.client.get("/metrics")).text
    for name in ["moetier_gateway_time_to_first_token_seconds_bucket", "moetier_gateway_inter_token_latency_seconds_count",
                 "moetier_gateway_e2e_request_latency_seconds_sum", "moetier_gateway_queue_time_seconds_count",
                 "moetier_gateway_prompt_tokens_total", "moetier_gateway_generation_tokens_total",
                 "moetier_gateway_running_requests"]:
        assert name in text, name
    reg = gw.app.state.gateway.metrics.registry
    assert reg.get_sample_value("moetier_gateway_finished_requests_total", {"finish_reason": "stop"}) == 1
    assert reg.get_sample_value("moetier_gateway_finished_requests_total", {"finish_reason": "length"}) == 1
    assert reg.get_sample_value("moetier_gateway_http_requests_total",
                                {"endpoint": "/v1/chat/completions", "status": "200"}) == 2
    assert reg.get_sample_value("moetier_gateway_http_requests_total",
                                {"endpoint": "/v1/chat/completions", "status": "404"}) == 1
    assert reg.get_sample_value("moetier_gateway_queue_time_seconds_sum") == pytest.approx(0.004)
    assert reg.get_sample_value("moetier_gateway_running_requests") == 0
    n = len(reply_script(gw.model.tokenizer))
    assert reg.get_sample_value("moetier_gateway_generation_tokens_total") == n + 2


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "gateway.md").read_text()
    names = {m.name + ("_total" if m.type == "counter" else "")
             for m in GatewayMetrics().registry.collect() if m.name.startswith("moetier_gateway_")}
    assert len(names) == 9
    assert not [n for n in names if f"`{n}`" not in doc]
