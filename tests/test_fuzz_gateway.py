"""schemathesis on every endpoint the gateway serves, each with its own budget of generated
cases (test_gateway_served.py's run shares one budget among all of them), against the gateway
under uvicorn with the fake router behind it. Per case: no 5xx; a refusal is the error envelope
of its API with a message; and a refused request (4xx) never reached the router. Endpoints outside
the schema (the dashboard) get arbitrary query strings and headers. A test keeps the list of
fuzzed endpoints equal to the app's routes, so a new endpoint cannot be left out."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_fuzz import TIMEOUT_S, app_routes, fuzz_settings, seeded
from helpers_gateway import MODEL, Served, gateway_settings, make_model_dir, served
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.app import create_app
from services.gateway.model import ServedModel

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation.modes import GenerationMode  # noqa: E402

pytestmark = pytest.mark.timeout(TIMEOUT_S)

# (method, path) of every route the app serves; the schema's operations plus these, exactly
OUTSIDE_SCHEMA = {("GET", "/dashboard"), ("GET", "/dashboard/heat"), ("GET", "/dashboard/stats")}
DOCS = {("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),
        ("HEAD", "/openapi.json"), ("HEAD", "/docs"), ("HEAD", "/docs/oauth2-redirect"), ("HEAD", "/redoc")}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("models")))) as s:
        yield s


@pytest.fixture(scope="module")
def schema(gw: Served) -> Any:
    return schemathesis.openapi.from_dict(httpx.get(f"{gw.url}/openapi.json").json())


def _operations(schema: Any) -> list[tuple[str, str]]:
    return sorted((op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations()))


def test_every_route_is_fuzzed(schema: Any, tmp_path: Path) -> None:
    app = create_app(gateway_settings(1), model=ServedModel.from_dir(make_model_dir(tmp_path)))
    assert app_routes(app) == set(_operations(schema)) | OUTSIDE_SCHEMA | DOCS


def _ours(case: Any) -> Any:
    """Mostly the served model, so most requests get past the model check."""
    body = case.body
    if isinstance(body, dict) and "model" in body and zlib.crc32(repr(body).encode()) % 4:
        body["model"] = MODEL
    return case


OPERATIONS = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "GET /metrics",
              "POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens"]


def test_the_fuzzed_operations_are_the_schema(schema: Any) -> None:
    assert sorted(OPERATIONS) == sorted(f"{m} {p}" for m, p in _operations(schema))


# negative cases for every operation that takes input (the GETs take none: nothing invalid to send)
CASES = [(op, "positive") for op in OPERATIONS] + [(op, "negative") for op in OPERATIONS if op.startswith("POST")]


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_schemathesis_per_endpoint(gw: Served, schema: Any, operation: str, mode: str) -> None:
    method, path = operation.split(" ")
    op = schema[path][method]
    failures: list[str] = []
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE

    @seeded
    @fuzz_settings(20 if mode == "positive" else 12)
    @given(case=op.as_strategy(generation_mode=generation).map(_ours))
    def check(case: Any) -> None:
        before = len(gw.fake.requests)
        r = case.call(base_url=gw.url, timeout=10)
        what = f"{case.method} {case.path} {repr(case.body)[:300]} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 500:
            failures.append(what)
        elif r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = None
            if not (isinstance(message, str) and message.strip()):
                failures.append("no error envelope: " + what)
            if r.status_code != 429 and len(gw.fake.requests) != before:
                failures.append("refused after the router saw it: " + what)

    gw.fake.reset()
    check()
    assert not failures, "\n".join(failures[:5])


QUERY = st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3)
HEADERS = st.dictionaries(st.sampled_from(["accept", "x-api-key", "authorization", "if-none-match", "range",
                                           "x-forwarded-for", "cookie"]),
                          # printable ASCII without surrounding blanks (what a client can send at all)
                          st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24).map(str.strip),
                          max_size=3)


@seeded
@fuzz_settings(30)
@given(path=st.sampled_from(sorted(p for _, p in OUTSIDE_SCHEMA)), query=QUERY, headers=HEADERS)
def test_fuzz_dashboard_endpoints(gw: Served, path: str, query: dict[str, str], headers: dict[str, str]) -> None:
    r = httpx.get(f"{gw.url}{path}", params=query, headers=headers, timeout=10)
    assert r.status_code < 500, f"{path} {query} {headers} -> {r.status_code} {r.text[:300]}"
