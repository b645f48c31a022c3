"""The gateway served by uvicorn on a free port (fake router behind it), driven by real
HTTP clients: the official `openai` package, raw sockets that hang up, schemathesis."""

from __future__ import annotations

import socket
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from helpers_gateway import MODEL, REPLY, Emit, Fail, Hang, Served, make_model_dir, served, wait_for

from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(90)

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def server(model: ServedModel) -> Iterator[Served]:
    with served(model) as s:
        yield s


@pytest.fixture
def gw(server: Served) -> Served:
    server.fake.reset()
    return server


@pytest.fixture
def client(gw: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_openai_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_openai_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=2)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 2
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once", max_tokens=50, stream=True) if c.choices)
    assert text == REPLY


def test_openai_models_and_errors(gw: Served, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)  # type: ignore[arg-type]
    gw.fake.script = lambda r: [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_ms=1000)]
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert e.value.response.headers["retry-after"] == "1"


def test_streaming_client_that_disconnects_cancels_the_generation(gw: Served) -> None:
    gw.fake.script = lambda r: [Emit([40]), Emit([41]), Hang()]
    with httpx.Client(timeout=10) as http, http.stream(
            "POST", f"{gw.url}/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "stream": True}) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the connection is closed here, with the generation still running
    assert wait_for(gw.fake.cancelled.is_set), "the router call was not cancelled"
    assert wait_for(lambda: _running(gw) == 0)


def test_non_streaming_client_that_disconnects_cancels_the_generation(gw: Served) -> None:
    gw.fake.script = lambda r: [Hang()]
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(gw.fake.started.is_set)
    assert wait_for(gw.fake.cancelled.is_set), "the router call was not cancelled"
    assert wait_for(lambda: _running(gw) == 0)


def _running(gw: Served) -> float:
    text = httpx.get(f"{gw.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("moetier_gateway_running_requests "))
    return float(line.split()[1])


@pytest.mark.timeout(400)  # five endpoints' worth of generated cases on a busy machine
def test_schemathesis_finds_no_server_errors(gw: Served) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_dict(httpx.get(f"{gw.url}/openapi.json").json())

    def with_our_model(case: schemathesis.Case) -> schemathesis.Case:
        if isinstance(case.body, dict) and "model" in case.body and zlib.crc32(str(case.body).encode()) % 4:
            case.body["model"] = MODEL  # mostly the served model, so requests reach the router
        return case

    failures: list[str] = []
    for mode, n in ((GenerationMode.POSITIVE, 80), (GenerationMode.NEGATIVE, 50)):
        @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode).map(with_our_model))
        def check(case: schemathesis.Case) -> None:
            r = case.call(base_url=gw.url, timeout=10)
            if r.status_code >= 500:
                failures.append(f"{case.method} {case.path} {repr(case.body)[:300]} -> {r.status_code} {r.text[:300]}")

        check()
    assert not failures, "\n".join(failures[:5])


def test_model_dir_name_is_the_default_model_id(tmp_path: Path) -> None:
    m = ServedModel.from_dir(make_model_dir(tmp_path))
    assert m.name == MODEL and m.context_limit(4096) == 256 and m.context_limit(100) == 100
    assert ServedModel.from_dir(make_model_dir(tmp_path), "other").name == "other"
