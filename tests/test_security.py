"""The security review (docs/security.md), one test per point: what listens where, the API key,
request limits enforced before any work, paths that stay in the model and data directories,
no pickle and no remote code, sandboxed templates, and logs without prompts or keys."""

from __future__ import annotations

import ast
import hmac
import ipaddress
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_fuzz import app_routes
from helpers_gateway import MODEL, InProcess, in_process, make_model_dir

from moetier.errors import InvalidArgument
from moetier.launch import listen_addresses, service_specs
from moetier.rpc.serving import metrics_host
from moetier.settings import load_settings
from moetier.text.template import ChatTemplate
from services.gateway import middleware
from services.gateway.model import ServedModel
from services.gateway.protocol import MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_STOPS, MAX_TOOLS

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-7f3a9c1e5b"
PROMPT = "my secret prompt about aardvark-zebra-4417"
# Routes open with an API key set (docs/security.md says why); every other route needs the key.
OPEN = {"/health", "/metrics", "/dashboard", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


# ---- what listens where --------------------------------------------------------------------------
def test_every_service_listens_on_loopback_by_default() -> None:
    s = load_settings(environ={})
    addresses = listen_addresses(s)
    assert {"router", "dense_worker", "expert_store", "gateway"} <= set(addresses)
    for what, (host, _) in addresses.items():
        assert _loopback(host), f"{what} listens on {host} by default"
    for name in ("router", "dense_worker", "expert_store"):
        assert _loopback(metrics_host(getattr(s, name).bind))  # /metrics beside it


def test_only_the_gateway_listens_beyond_loopback_and_only_when_asked() -> None:
    s = load_settings(overrides={"gateway": {"bind": "0.0.0.0:8000"}}, environ={})
    public = {what for what, (host, _) in listen_addresses(s).items() if not _loopback(host)}
    assert public == {"gateway"}
    # `moetier up` passes no bind of its own: each service listens where the settings say
    for spec in service_specs(load_settings(environ={}), Path("/m"), None):
        assert not [k for k in spec.env if "BIND" in k or "ADDRESS" in k], spec.env


def test_compose_publishes_only_the_gateway_and_the_observers_on_loopback() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = {name for name, svc in compose["services"].items() if svc.get("ports")}
    assert published == {"gateway"}, "an internal service publishes a port"
    overlay = ROOT / "deploy" / "compose.observe.yml"
    if overlay.exists():
        for name, svc in yaml.safe_load(overlay.read_text())["services"].items():
            for port in svc.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


# ---- the API key -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return ServedModel.from_dir(make_model_dir(tmp_path_factory.mktemp("models")))


@pytest.fixture
async def keyed(model: ServedModel) -> AsyncIterator[InProcess]:
    async with in_process(model, api_key=KEY) as g:
        yield g


def _protected(path: str) -> bool:
    return path.startswith(middleware.PROTECTED)


async def test_the_key_is_required_on_every_route_that_generates_or_reveals_the_model(keyed: InProcess) -> None:
    routes = app_routes(keyed.app)
    assert {p for _, p in routes if not _protected(p)} == OPEN, "a new route: decide and document (security.md)"
    protected = sorted((m, p) for m, p in routes if _protected(p) and m != "HEAD")
    assert len(protected) >= 8
    for method, path in protected:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
                "max_tokens": 2} if method == "POST" else None
        seen = len(keyed.fake.requests)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {KEY}x"},
                        {"x-api-key": KEY[:-1]}, {"authorization": f"Basic {KEY}"}):
            r = await keyed.client.request(method, path, json=body, headers=headers, params={"api_key": KEY})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["message"] and KEY not in r.text
        assert len(keyed.fake.requests) == seen, f"the router saw a request to {path} without the key"
        for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            r = await keyed.client.request(method, path, json=body, headers=headers)
            assert r.status_code != 401, (method, path, headers, r.text)
    assert keyed.fake.requests, "no request with the key reached the router: the test proves nothing"


async def test_open_routes_reveal_neither_the_model_nor_the_key(keyed: InProcess) -> None:
    """/health (probes), /metrics (Prometheus) and the dashboard's page answer without the key; what
    they show is state and counters, never the model's name, a prompt or the key."""
    for path in sorted(OPEN):
        r = await keyed.client.get(path)
        assert r.status_code in (200, 503), (path, r.status_code)
        assert MODEL not in r.text and KEY not in r.text, path
    doc = (ROOT / "docs" / "security.md").read_text()
    for path in sorted(OPEN | {p for p in middleware.PROTECTED}):
        assert f"`{path}" in doc, f"docs/security.md does not say why {path} is open or closed"


async def test_the_key_is_compared_in_constant_time(keyed: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    assert (await keyed.client.get("/v1/models", headers={"authorization": "Bearer nope"})).status_code == 401
    assert (await keyed.client.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
    assert calls == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode())]
    # and no other comparison of the key anywhere in the gateway
    for path in (ROOT / "services" / "gateway").glob("*.py"):
        src = path.read_text()
        assert not re.search(r"(==|!=)\s*(self\.)?(key|api_key)\b|\b(key|api_key)\s*(==|!=)", src), path


# ---- limits before work --------------------------------------------------------------------------
def _msgs(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(n)]


def _tools(n: int, anthropic: bool = False) -> list[dict[str, Any]]:
    if anthropic:
        return [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(n)]
    return [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(n)]


CHAT, MSG = "/v1/chat/completions", "/v1/messages"
OVER_LIMITS = [
    (CHAT, {"messages": _msgs(MAX_MESSAGES + 1)}, "messages"),
    (CHAT, {"messages": _msgs(1), "tools": _tools(MAX_TOOLS + 1)}, "tools"),
    (CHAT, {"messages": _msgs(1), "stop": ["a"] * (MAX_STOPS + 1)}, "stop"),
    (CHAT, {"messages": _msgs(1), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": _msgs(1), "max_tokens": 10**6}, "max"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * (MAX_STOPS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "max"),
    (MSG, {"messages": _msgs(MAX_MESSAGES + 1), "max_tokens": 4}, "messages"),
    (MSG, {"messages": _msgs(1), "max_tokens": 4, "tools": _tools(MAX_TOOLS + 1, True)}, "tools"),
    (MSG, {"messages": _msgs(1), "max_tokens": 4, "stop_sequences": ["a"] * (MAX_STOP_SEQUENCES + 1)},
     "stop_sequences"),
    (MSG, {"messages": _msgs(1), "max_tokens": 10**6}, "max"),
    ("/v1/responses", {"input": _msgs(MAX_MESSAGES + 1)}, "input"),
    ("/v1/responses", {"input": "hi", "tools": _tools(MAX_TOOLS + 1)}, "tools"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, "max"),
]


@pytest.fixture
async def gw(model: ServedModel) -> AsyncIterator[InProcess]:
    async with in_process(model, max_body_bytes=1 << 20) as g:
        yield g


@pytest.mark.parametrize(("path", "body", "names"), OVER_LIMITS, ids=[f"{p}-{n}" for p, _, n in OVER_LIMITS])
async def test_limits_are_enforced_before_the_router_sees_the_request(gw: InProcess, path: str,
                                                                     body: dict[str, Any], names: str) -> None:
    r = await gw.client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert names in r.json()["error"]["message"] or names in str(r.json()["error"].get("param")), r.text
    assert gw.fake.requests == [], "the router saw a request over a limit"
    # the same request within the limits reaches it (the limit is what refused it)
    assert (await gw.client.post(CHAT, json={"model": MODEL, "messages": _msgs(1), "max_tokens": 2})).status_code == 200
    assert len(gw.fake.requests) == 1


async def test_body_size_is_refused_before_it_is_read(gw: InProcess) -> None:
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    r = await gw.client.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1048576 bytes" in r.json()["error"]["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while it streams
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = await gw.client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert gw.fake.requests == []


# ---- paths ---------------------------------------------------------------------------------------
def test_no_config_value_names_a_file_outside_the_data_directory() -> None:
    """The store's id names its usage history under data_dir/history: a separator or '..' would lead out."""
    for bad in ("../../etc/cron.d/x", "a/b", "a\\b", "..", ".", "x\0y", "", "x" * 129):
        with pytest.raises(InvalidArgument, match=r"expert_store\.id"):
            load_settings(overrides={"expert_store": {"id": bad}}, environ={})
    for good in ("store-1.a_b", "$(POD_NAME)"):  # Kubernetes expands the second in the pod's environment
        assert load_settings(overrides={"expert_store": {"id": good}}, environ={}).expert_store.id == good


async def test_a_request_names_no_file(gw: InProcess) -> None:
    """The model a request names is compared with the served one, never looked up on disk."""
    for name in ("../" * 8 + "etc/passwd", "/etc/passwd", f"{MODEL}/../{MODEL}", "."):
        r = await gw.client.post(CHAT, json={"model": name, "messages": _msgs(1)})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert gw.fake.requests == []


def test_prefix_cache_reads_no_link_out_of_its_directory(tmp_path: Path) -> None:
    from test_dense_worker_prefix import IDENTITY, MID, ids_of, kv_of

    from moetier.convert.synth import preset_args
    from moetier.prefix_cache import PrefixCache

    args = preset_args("tiny-mixtral")
    outside, cache_dir = tmp_path / "outside", tmp_path / "cache"
    outside.mkdir()
    a = PrefixCache(args, MID, IDENTITY, outside, 1 << 30)
    a.insert(kv_of(args, ids_of(40, 1)))
    a.close()
    (f,) = outside.iterdir()
    cache_dir.mkdir()
    (cache_dir / f.name).symlink_to(f)  # a valid file, reached through a link
    b = PrefixCache(args, MID, IDENTITY, cache_dir, 1 << 30)
    assert b.stats().entries == 0 and b.stats().files_rejected == 1
    assert f.exists() and not (cache_dir / f.name).exists()
    b.close()


# ---- no pickle, no remote code -----------------------------------------------------------------
def _code_files() -> list[Path]:
    return sorted(p for d in ("moetier", "services", "scripts") for p in (ROOT / d).rglob("*.py")
                  if "rpc/v1" not in p.as_posix())


def test_no_pickle_and_no_remote_code_anywhere() -> None:
    """No module imports pickle (or its relatives); no call passes trust_remote_code or allow_pickle
    other than False (numpy's default), or calls torch.load (a pickle)."""
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    problems: list[str] = []
    for path in _code_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom)
                                                        and node.module else [])
                problems += [f"{where}: imports {n}" for n in names if n.split(".")[0] in banned_modules]
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                problems.append(f"{where}: trust_remote_code")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is False):
                problems.append(f"{where}: allow_pickle not False")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if node.func.attr == "load" and owner == "torch":
                    problems.append(f"{where}: torch.load")
    assert not problems, "\n".join(problems)
    text = "\n".join(p.read_text() for p in _code_files())
    assert "trust_remote_code" not in text


# ---- templates -----------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ messages[0].update({'role': 'x'}) }}",  # the immutable sandbox: no mutation of the inputs
    "{% for i in range(10**9) %}{% endfor %}",  # the sandbox's range cap
])
def test_templates_render_in_the_sandbox(template: str) -> None:
    with pytest.raises(InvalidArgument, match="chat template rejected"):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


# ---- logs ---------------------------------------------------------------------------------------
async def test_logs_never_contain_prompts_or_keys(model: ServedModel, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with in_process(model, api_key=KEY) as g:
        auth = {"authorization": f"Bearer {KEY}"}
        for path, body in ((CHAT, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}),
                           (CHAT, {"messages": [{"role": "user", "content": PROMPT}], "stream": True}),
                           ("/v1/completions", {"prompt": PROMPT}),
                           (MSG, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}),
                           ("/v1/responses", {"input": PROMPT}),
                           (CHAT, {"messages": [{"role": "user", "content": PROMPT}], "temperature": 9})):
            await g.client.post(path, json={"model": MODEL, **body}, headers=auth)
        await g.client.get("/v1/models", headers={"authorization": f"Bearer {KEY}-wrong"})
        assert len(g.fake.requests) >= 5
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert logged, "nothing was logged: the capture did not work"
    for secret in (PROMPT, "aardvark", KEY):
        assert secret not in logged, f"{secret!r} is in the logs"
