"""The clients of the seed document against a real `moetier up` on the demo model: the Codex
CLI (`codex exec`, config.toml with a model provider on wire_api "responses") and Claude
Code (`claude -p` with ANTHROPIC_BASE_URL / ANTHROPIC_AUTH_TOKEN / ANTHROPIC_MODEL), each
exiting 0 with the model's text; the official `anthropic` and `openai` SDKs (create, stream);
and structured outputs on the random demo model: over 50 generated JSON schemas, every
json_schema answer (chat), text.format answer (responses) and forced tool call (messages,
chat) validates against its schema.

The CLIs come from npm (.ci/run installs them); where they are missing the tests skip.
Their requests carry 15-25k tokens of instructions and tools: the demo model's context is
65536 positions, and the second request of an agent finds its preamble in the prefix cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from helpers_up import Up, moetier_up, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grammar import SCHEMAS

pytestmark = pytest.mark.timeout(900)

MODEL = "demo"
CLI_TIMEOUT_S = 600
MAX_TOKENS = 160  # answers of the constrained tests (the schemas are fitted to it)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    config, ports = write_config(tmp_path_factory.mktemp("agents"))
    with moetier_up(config, ports) as up:
        up.wait_up(600)
        yield up


def _cli(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"`{name}` is not installed (npm; .ci/run installs it)")
    return found


def _env(home: Path, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return {**keep, "HOME": str(home), **extra}


def test_codex_exec(cluster: Up, tmp_path: Path) -> None:
    codex = _cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    # As the seed document configures Codex: a model provider with base_url and env_key. moetier has
    # no hosted web search, so Codex's own is off (Codex would send it as a `web_search` tool).
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "moetier"
web_search = "disabled"

[model_providers.moetier]
name = "moetier"
base_url = "{cluster.url}/v1"
env_key = "MOETIER_API_KEY"
wire_api = "responses"
""")
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([codex, "exec", "--skip-git-repo-check", "Say hello."], cwd=work, capture_output=True,
                       text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                       env=_env(tmp_path, CODEX_HOME=str(home), MOETIER_API_KEY="unused"))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), r.stderr[-3000:]  # the model's last message


def test_claude_code_print(cluster: Up, tmp_path: Path) -> None:
    claude = _cli("claude")
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path, ANTHROPIC_BASE_URL=cluster.url, ANTHROPIC_AUTH_TOKEN="unused", ANTHROPIC_MODEL=MODEL,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    r = subprocess.run([claude, "-p", "Say hello."], cwd=work, capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), r.stderr[-3000:]


# ---- the SDKs on the real model ----------------------------------------------------------
def test_anthropic_sdk(cluster: Up) -> None:
    c = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)
    m = c.messages.create(model=MODEL, max_tokens=12, temperature=0, messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    with c.messages.stream(model=MODEL, max_tokens=12, temperature=0,
                           messages=[{"role": "user", "content": "Hi"}]) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in m.content]


def test_openai_responses_sdk(cluster: Up) -> None:
    c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=12, temperature=0)
    events = list(c.responses.create(model=MODEL, input="Hi", max_output_tokens=12, temperature=0, stream=True))
    assert events[-1].response.output_text == r.output_text  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.output_tokens <= 12


# ---- structured outputs on the random model --------------------------------------------------
def _constrained(cluster: Up, api: str, schema: dict[str, Any], seed: int) -> Any:
    """One constrained answer through `api`, as the value the schema must hold."""
    ask = "Answer with the data."
    if api == "chat-json":
        c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}], seed=seed,
                                      max_tokens=MAX_TOKENS, response_format={
                                          "type": "json_schema",
                                          "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        return json.loads(r.choices[0].message.content or "")
    if api == "responses-json":
        c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)
        resp = c.responses.create(model=MODEL, input=ask, max_output_tokens=MAX_TOKENS, text={
            "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
        assert resp.status == "completed"
        return json.loads(resp.output_text)
    wrapped = schema if schema.get("type") == "object" else {
        "type": "object", "properties": {"value": schema}, "required": ["value"]}
    if api == "chat-tool":
        c = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}], seed=seed,
                                      max_tokens=MAX_TOKENS, tool_choice="required", tools=[{
                                          "type": "function", "function": {"name": "answer", "parameters": wrapped}}])
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    else:
        a = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=300)
        m = a.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask}],
                              tool_choice={"type": "any"},
                              tools=[{"name": "answer", "input_schema": wrapped}])  # type: ignore[list-item,typeddict-item]
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1
        args = uses[0].input
    return args if schema.get("type") == "object" else args["value"]


APIS = ("chat-json", "responses-json", "chat-tool", "messages-tool")


@settings(max_examples=52, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, n=st.integers(0, 2**16))
def test_generated_schemas_validate_on_the_demo_model(cluster: Up, schema: dict[str, Any], n: int) -> None:
    api = APIS[n % len(APIS)]
    jsonschema.validate(_constrained(cluster, api, schema, n), schema)
