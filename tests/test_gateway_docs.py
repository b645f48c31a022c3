"""docs/gateway.md is complete: every route, every error code the gateway can answer, every
Anthropic error type and every tool-call format has its row; and every bad input to the new
endpoints gets its API's envelope and the documented status."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers_gateway import MODEL, InProcess, gateway_settings, in_process, make_model_dir

from moetier.text.tools import FORMATS
from services.gateway.app import create_app
from services.gateway.errors import ANTHROPIC_TYPES
from services.gateway.model import ServedModel

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "gateway.md").read_text()


def _table(heading_line: str) -> list[list[str]]:
    """The rows (cells) of the first table after the line that contains heading_line."""
    lines = DOC.splitlines()
    start = next(i for i, line in enumerate(lines) if heading_line in line)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    d = make_model_dir(tmp_path_factory.mktemp("m"))
    (d / "moetier.json").write_text('{"model": {"max_position_embeddings": 2048}}')
    return ServedModel.from_dir(d)


def test_every_route_has_a_row(model: ServedModel) -> None:
    paths = create_app(gateway_settings(1), model=model).openapi()["paths"]
    documented = " ".join(r[0] for r in _table("## Endpoints"))
    routes = [(m.upper(), p) for p, ops in paths.items() if p.startswith(("/v1", "/health")) for m in ops]
    assert len(routes) >= 7
    assert [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in documented] == []


def test_every_error_code_has_a_row() -> None:
    codes = {c for f in (ROOT / "services" / "gateway").glob("*.py")
             for c in re.findall(r'code="([a-z_]+)"', f.read_text())}
    rows = _table("On the OpenAI paths")
    assert len(codes) >= 12
    assert sorted(codes - {r[3] for r in rows}) == []


def test_every_anthropic_error_type_has_a_row() -> None:
    rows = {(int(r[0]), r[1]) for r in _table("the same errors come in")}
    assert set(ANTHROPIC_TYPES.items()) - {(405, "invalid_request_error"), (422, "invalid_request_error")} <= rows
    assert (529, "overloaded_error") in rows


def test_every_tool_format_has_a_row() -> None:
    assert sorted(FORMATS) == sorted(r[0].strip("`") for r in _table("overrides the choice:"))


# ---- bad inputs to the new endpoints: their envelope and status ---------------------------------
MSG = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
RESP = {"model": MODEL, "input": "Hi"}
TOOL = {"name": "f", "input_schema": {"type": "object"}}
BAD: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("/v1/messages", "no max_tokens", {"model": MODEL, "messages": MSG["messages"]}, 400, "max_tokens"),
    ("/v1/messages", "bad role", {**MSG, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("/v1/messages", "image block", {**MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "image"),
    ("/v1/messages", "temperature > 1", {**MSG, "temperature": 1.5}, 400, "temperature"),
    ("/v1/messages", "unknown model", {**MSG, "model": "claude-x"}, 404, "claude-x"),
    ("/v1/messages", "over the context", {**MSG, "max_tokens": 2040}, 400, "maximum context length"),
    ("/v1/messages", "tool_choice names no tool", {**MSG, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}},
     400, "`g`"),
    ("/v1/messages", "tool_choice any without tools", {**MSG, "tool_choice": {"type": "any"}}, 400, "needs tools"),
    ("/v1/messages", "a server tool", {**MSG, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "tools"),
    ("/v1/messages", "unenforceable schema", {**MSG, "tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}],
        "tool_choice": {"type": "any"}}, 400, "uniqueItems"),
    ("/v1/messages/count_tokens", "no messages", {"model": MODEL}, 400, "messages"),
    ("/v1/responses", "no input", {"model": MODEL}, 400, "input"),
    ("/v1/responses", "hosted tool", {**RESP, "tools": [{"type": "web_search"}]}, 400, "web_search"),
    ("/v1/responses", "previous_response_id", {**RESP, "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("/v1/responses", "image part", {**RESP, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input_image"),
    ("/v1/responses", "unknown item", {**RESP, "input": [{"type": "computer_call", "id": "c"}]}, 400, "computer_call"),
    ("/v1/responses", "unknown model", {**RESP, "model": "gpt-x"}, 404, "gpt-x"),
    ("/v1/responses", "unenforceable format", {**RESP, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"not": {"type": "string"}}}}}, 400, "not"),
    ("/v1/chat/completions", "tool_choice without tools", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", "image part", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "image_url"),
    ("/v1/chat/completions", "tool message without id", {"model": MODEL, "messages": [
        {"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{c[0]} {c[1]}" for c in BAD])
async def test_bad_inputs_get_their_envelope(model: ServedModel, case: tuple[str, str, dict[str, Any], int, str]) -> None:
    path, _, body, status, says = case
    gw: InProcess
    async with in_process(model) as gw:
        r = await gw.client.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
        assert not gw.fake.requests  # nothing reached the router
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/v1/messages"):
        assert set(err) == {"type", "error"} and err["type"] == "error"
        assert err["error"]["type"] == ANTHROPIC_TYPES[status] and says in err["error"]["message"]
    else:
        assert set(err) == {"error"} and says in err["error"]["message"]
        assert err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
async def test_tools_for_a_template_without_tools(tmp_path: Path, path: str) -> None:
    d = make_model_dir(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = ServedModel.from_dir(d)
    assert model.tool_format is None
    fn = {"name": "f", "parameters": {"type": "object"}}
    body = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                     "tools": [{"type": "function", "function": fn}]},
            "/v1/responses": {**RESP, "tools": [{"type": "function", **fn}]},
            "/v1/messages": {**MSG, "tools": [TOOL]}}[path]
    async with in_process(model) as gw:
        r = await gw.client.post(path, json=body)
        assert not gw.fake.requests
    assert r.status_code == 400 and "does not render tools" in r.text
