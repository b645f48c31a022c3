"""Acceptance of a running `moetier up` (the real command, its own data_dir and ports, the demo
model it builds, an API key set through the environment), driven as clients drive it: the
printed curl, the official `openai` package, malformed requests, schemathesis, and a crowd of
streaming clients that give up. The in-process Engine on the same container is the reference
for every token."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from helpers_up import Up, eventually, metrics, moetier_up, write_config

from moetier.bench.cancel import impatient
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc
from moetier.settings import load_settings
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(240)

KEY = "test-key-7f3a"  # set through MOETIER_GATEWAY__API_KEY, as the docs advise
CONTEXT = 4096  # inference.max_seq_len of this module's cluster
MODEL = "demo"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    # A context of CONTEXT positions (the demo model has more): the over-the-context cases stay
    # short to tokenize and are refused before any prefill.
    config, ports = write_config(tmp_path_factory.mktemp("up"), {"inference": {"max_seq_len": CONTEXT}})
    with moetier_up(config, ports, env={"MOETIER_GATEWAY__API_KEY": KEY}) as up:
        up.wait_up(180)
        yield up


@dataclass
class Reference:
    """The in-process engine on the container the cluster serves, and the gateway's text side."""

    engine: Engine
    served: ServedModel

    def generate(self, ids: list[int], max_tokens: int) -> str:
        tok = self.served.tokenizer
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=tuple(tok.eos_token_ids),
                                ignore_eos=True)  # the eos ids are the stop ids, as the gateway sends them
        return tok.decode([g.token for g in self.engine.generate(ids, params)])

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        tok = self.served.tokenizer
        assert tok.chat_template is not None
        # as services/gateway/api.py: the template with the generation prompt, no extra special tokens
        return self.generate(tok.encode(tok.chat_template.render(messages), add_special_tokens=False), max_tokens)

    def completion(self, prompt: str, max_tokens: int) -> str:
        return self.generate(self.served.tokenizer.encode(prompt, add_special_tokens=True), max_tokens)


@pytest.fixture(scope="module")
def reference(cluster: Up) -> Iterator[Reference]:
    model_dir = cluster.data_dir / "models" / MODEL
    with Engine.open(model_dir, budget="100%") as engine:
        yield Reference(engine, ServedModel.from_dir(model_dir))


@pytest.fixture
def client(cluster: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=60)


# ---- what `moetier up` prints ------------------------------------------------------------


def test_prints_the_url_and_a_curl_that_works(cluster: Up) -> None:
    assert cluster.wait_for(r"^moetier is up: (\S+)/v1", 0).group(1) == cluster.url
    curl = cluster.wait_for(r"^\s+(curl .*)$", 0).group(1)
    assert f"{cluster.url}/v1/chat/completions" in curl and "$MOETIER_GATEWAY__API_KEY" in curl
    assert "gateway.api_key is set" in cluster.output()  # says where the curl takes the key from
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the printed command cannot be run as printed")
    # run as a user pastes it: into a shell where the key is in the environment
    r = subprocess.run(["bash", "-c", curl + " --silent --show-error --max-time 60"], capture_output=True,
                       text=True, timeout=90, env={**os.environ, "MOETIER_GATEWAY__API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion" and body["model"] == MODEL, body
    assert body["choices"][0]["message"]["content"] and 0 < body["usage"]["completion_tokens"] <= 32


# ---- the official openai client, token for token against the in-process engine ---------------

MESSAGES = [{"role": "user", "content": "Tell me about the disks and the experts of this machine."}]


def test_openai_chat_non_streaming_and_streaming_equal_the_in_process_engine(
        client: openai.OpenAI, reference: Reference) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.model == MODEL and r.choices[0].message.role == "assistant"
    assert r.usage is not None
    n, finish = r.usage.completion_tokens, r.choices[0].finish_reason  # the trained demo may end before 20
    assert (finish, n) == ("length", 20) or (finish == "stop" and 0 < n < 20), (finish, n)

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (r.usage.prompt_tokens, n)
    assert all(c.usage is None for c in chunks[:-1])

    assert streamed == text
    assert text == reference.chat(MESSAGES, 20)


def test_openai_completions_equal_the_in_process_engine(client: openai.OpenAI, reference: Reference) -> None:
    prompt = "The expert store reads"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    assert r.object == "text_completion" and r.usage is not None
    n, finish = r.usage.completion_tokens, r.choices[0].finish_reason  # the trained demo may end before 16
    assert (finish, n) == ("length", 16) or (finish == "stop" and 0 < n < 16), (finish, n)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert r.choices[0].text == streamed == reference.completion(prompt, 16)


def test_openai_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


# ---- malformed requests, end to end ----------------------------------------------------------

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
JSON = {"content-type": "application/json"}

# name, request keywords, status, error type, error code, param (docs/gateway.md, "Errors")
BAD: list[tuple[str, dict[str, Any], int, str, str | None, str | None]] = [
    ("bad json", {"content": b'{"model": "demo", "messages": [', "headers": JSON},
     400, "invalid_request_error", "invalid_json", None),
    ("wrong content type", {"content": json.dumps(CHAT).encode(), "headers": {"content-type": "text/plain"}},
     400, "invalid_request_error", "invalid_content_type", None),
    ("messages not a list", {"json": {**CHAT, "messages": "hi"}}, 400, "invalid_request_error", "invalid_value",
     "messages"),
    ("temperature a string", {"json": {**CHAT, "temperature": "hot"}}, 400, "invalid_request_error",
     "invalid_value", "temperature"),
    ("max_tokens a string", {"json": {**CHAT, "max_tokens": "many"}}, 400, "invalid_request_error",
     "invalid_value", "max_tokens"),
    ("negative max_tokens", {"json": {**CHAT, "max_tokens": -1}}, 400, "invalid_request_error", "invalid_value",
     "max_tokens"),
    ("unknown model", {"json": {**CHAT, "model": "gpt-4"}}, 404, "invalid_request_error", "model_not_found",
     "model"),
    ("max_tokens over the context", {"json": {**CHAT, "max_tokens": 10**6}}, 400, "invalid_request_error",
     "context_length_exceeded", "messages"),
    ("prompt over the context", {"json": {**CHAT, "max_tokens": None,
                                          "messages": [{"role": "user", "content": "word " * (CONTEXT + 100)}]}},
     400, "invalid_request_error", "context_length_exceeded", "messages"),
    ("10 MB body", {"content": b'{"model": "demo", "messages": [], "pad": "' + b"x" * 10_000_000 + b'"}',
                    "headers": JSON}, 413, "invalid_request_error", "request_too_large", None),
    ("no key", {"json": CHAT, "headers": {"Authorization": ""}}, 401, "authentication_error", "invalid_api_key",
     None),
    ("wrong key", {"json": CHAT, "headers": {"Authorization": "Bearer nope"}}, 401, "authentication_error",
     "invalid_api_key", None),
]


def _router_requests(cluster: Up) -> float:
    m = metrics(f"http://127.0.0.1:{cluster.ports['router_metrics']}/metrics")
    return sum(v for k, v in m.items() if k.startswith("moetier_router_requests_total"))


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_malformed_request_gets_its_status_and_the_envelope(
        cluster: Up, case: tuple[str, dict[str, Any], int, str, str | None, str | None]) -> None:
    _name, request, status, etype, code, param = case
    kwargs = dict(request)
    headers = {k: v for k, v in {**AUTH, **kwargs.pop("headers", {})}.items() if v}  # "": no such header
    before = _router_requests(cluster)
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert (err["type"], err["code"], err["param"]) == (etype, code, param), err
    assert _router_requests(cluster) == before, "a refused request reached the router"
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    if code == "context_length_exceeded":
        assert f"maximum context length is {CONTEXT} tokens" in err["message"]


def test_health_and_metrics_need_no_key(cluster: Up) -> None:
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{cluster.url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{cluster.url}/v1/models", timeout=10).status_code == 401


def test_schemathesis_on_the_real_gateway_finds_no_server_errors(cluster: Up, tmp_path: Path) -> None:
    """The fuzzing in test_gateway_served.py runs against a fake router; here the real cluster's
    schema is checked to be that same schema, and a shorter run goes all the way to the worker
    (positive cases with a small max_tokens, so each one is a real, short generation)."""
    schemathesis = pytest.importorskip("schemathesis")
    from helpers_gateway import make_model_dir
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    from services.gateway.app import create_app

    live = httpx.get(f"{cluster.url}/openapi.json", timeout=10).json()
    fake_router_app = create_app(load_settings(environ={}), model=ServedModel.from_dir(make_model_dir(tmp_path)))
    assert live == fake_router_app.openapi(), "the fuzzed schema is not the served one"

    schema = schemathesis.openapi.from_dict(live)

    def short(case: schemathesis.Case) -> schemathesis.Case:
        body = case.body
        if isinstance(body, dict):
            if "model" in body and zlib.crc32(repr(body).encode()) % 4:  # not hash(): salted per process
                body["model"] = MODEL
            if body.get("model") == MODEL:
                # A generation of at most 4 tokens: in a chat, absent or null means the rest of the
                # context, minutes of decoding on 2 cores (completions default to 16).
                for k in ("max_tokens", "max_completion_tokens"):
                    if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > 4:
                        body[k] = 4
                if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
                    body["max_tokens"] = 4
        return case

    failures: list[str] = []
    for mode, n in ((GenerationMode.POSITIVE, 25), (GenerationMode.NEGATIVE, 25)):
        @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode).map(short))
        def check(case: schemathesis.Case) -> None:
            r = case.call(base_url=cluster.url, headers=AUTH, timeout=30)
            if r.status_code >= 500:
                failures.append(f"{case.method} {case.path} {repr(case.body)[:300]} -> {r.status_code} {r.text[:300]}")

        check()
    assert not failures, "\n".join(failures[:5])


# ---- clients that give up -------------------------------------------------------------------


def _worker_load(cluster: Up) -> dense_worker_pb2.WorkerLoad:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.ports['dense_worker']}") as ch:
        load: dense_worker_pb2.WorkerLoad = dense_worker_pb2_grpc.DenseWorkerStub(ch).Load(
            dense_worker_pb2.LoadRequest(), timeout=5)
        return load


def test_200_abandoned_streams_leave_no_live_sequence(cluster: Up) -> None:
    worker_metrics = f"http://127.0.0.1:{cluster.ports['dense_worker_metrics']}/metrics"
    router_metrics = f"http://127.0.0.1:{cluster.ports['router_metrics']}/metrics"
    gateway_metrics = f"{cluster.url}/metrics"
    eventually(lambda: _worker_load(cluster).running == 0, 30, "no request of another test still running")
    baseline_kv = _worker_load(cluster).kv_bytes
    cancelled_before = metrics(worker_metrics).get('moetier_dense_worker_finished_requests_total{finish_reason="cancelled"}', 0)

    outcomes = asyncio.run(impatient(cluster.url, 200, AUTH))
    assert sum(outcomes.values()) == 200
    # No 429: the router's queue holds all 200, and the slot the router hands on when a client
    # hangs up is free on the worker too (a cancelled request stops counting against the worker's
    # admission at once, not at its next step boundary).
    assert set(outcomes) <= {"read timeout", "deadline", "completed"}, outcomes
    assert outcomes.get("deadline", 0) > 0, outcomes  # some were cut off mid-stream

    state = [""]

    def settled() -> bool:
        load = _worker_load(cluster)
        r, g = metrics(router_metrics), metrics(gateway_metrics)
        state[0] = (f"worker running={load.running} waiting={load.waiting} kv_bytes={load.kv_bytes} (baseline "
                    f"{baseline_kv}); router queue={r['moetier_router_queue_depth']} in_flight="
                    f"{r['moetier_router_in_flight']}; gateway running={g['moetier_gateway_running_requests']}")
        return (load.running == 0 and load.waiting == 0 and load.kv_bytes == baseline_kv
                and r["moetier_router_queue_depth"] == 0 and r["moetier_router_in_flight"] == 0
                and g["moetier_gateway_running_requests"] == 0)

    try:  # a bound only a stuck request misses, not a busy machine (it takes well under a second idle)
        eventually(settled, 120, "the cluster let go of every request")
    except AssertionError:
        pytest.fail(f"still holding requests after 120 s: {state[0]}\n{outcomes}")
    cancelled = metrics(worker_metrics)['moetier_dense_worker_finished_requests_total{finish_reason="cancelled"}']
    assert cancelled - cancelled_before > 0, "no cancellation reached the worker"

    # Served again, however long a busy machine takes (no timing here: `moetier bench cancel`
    # reports this latency beside the idle cluster's).
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Still there?"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    print(f"\n200 abandoned streams: {outcomes}; worker cancellations {cancelled - cancelled_before:.0f}")


def test_the_curl_line_quotes_for_a_shell() -> None:
    """The printed curl survives shlex (what a shell does to it) as one JSON body."""
    from moetier.launch import curl_command

    s = load_settings(environ={})
    argv = shlex.split(curl_command(s, "it's a \"model\""))
    assert json.loads(argv[argv.index("-d") + 1])["model"] == "it's a \"model\""
    assert not any(a.startswith("Authorization") for a in argv)
