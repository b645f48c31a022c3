"""The clients of the seed document against a real `moetier up` on the demo model: the Codex
CLI (`codex exec`, config.toml with a model provider on wire_api "responses") and Claude
Code (`claude -p` with ANTHROPIC_BASE_URL / ANTHROPIC_AUTH_TOKEN / ANTHROPIC_MODEL), each
understanding the streams and exiting 0 with the model's text (on a demo model that ends its
answers; the random one never does, so there exit 0 skips with the reason); the official `anthropic` and `openai` SDKs (create, stream);
and structured outputs on the random demo model: over 50 generated JSON schemas, every
json_schema answer (chat), text.format answer (responses) and forced tool call (messages,
chat) validates against its schema.

The CLIs come from npm (.ci/run installs them); where they are missing the tests skip.
By default their requests carry 16k (Codex) and 20k (Claude Code) tokens of instructions
and tools, which the demo model's 65536 positions hold; prefilled on two busy cores that
is many minutes per request, so here each CLI is given a short system prompt (Codex
`model_instructions_file`, no skills and fewer tools, Claude Code `--system-prompt` and no built-in
tools): the wire protocol, the streams and the exit are the same. The random demo model never
ends an answer by itself, so the cluster caps answers that set no length
(`gateway.default_max_tokens`) and Claude Code asks for a short one
(CLAUDE_CODE_MAX_OUTPUT_TOKENS). The full preambles are measured in the issue's figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]

MODEL = "demo"
CLI_TIMEOUT_S = 1800  # a Codex request is ~3.7k prompt tokens: minutes of prefill on two busy cores
MAX_TOKENS = 112  # answers of the constrained tests (the schemas are fitted to it)
ANSWER_TOKENS = 512  # the CLIs' answers: the trained demo ends its own within a few dozen tokens
# Codex sets no temperature: sampled at 1.0 after a prompt of tool schemas, the toy sometimes runs on past
# any length with JSON-like noise (greedy too, on some prompts: its answer depends on the date and the
# working directory Codex puts in the prompt). Here Codex sends no skills and one tool, and gets up to
# CODEX_TRIES turns for an answer that ends.
CODEX_TRIES = 3
# The Messages API's temperature; the anthropic SDK's create() no longer takes it by name (2.x).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    config, ports = write_config(tmp_path_factory.mktemp("agents"), {
        "gateway": {"default_max_tokens": ANSWER_TOKENS}, "inference": {"prefill_chunk": 512}})
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
    (tmp_path / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "moetier"
web_search = "disabled"
model_instructions_file = "{tmp_path / 'instructions.md'}"

[features]
multi_agent = false
goals = false
shell_tool = false
unified_exec = false
view_image = false

[skills]
include_instructions = false

[skills.bundled]
enabled = false

[model_providers.moetier]
name = "moetier"
base_url = "{cluster.url}/v1"
env_key = "MOETIER_API_KEY"
wire_api = "responses"
# Codex gives up on a stream silent for 5 minutes and retries (which starts the prefill over).
stream_idle_timeout_ms = {CLI_TIMEOUT_S * 1000}
""")
    work = tmp_path / "work"
    work.mkdir()
    too_long = "ERROR: Incomplete response returned, reason: max_output_tokens"
    for _ in range(CODEX_TRIES):
        r = subprocess.run([codex, "exec", "--skip-git-repo-check", "Say hello."], cwd=work, capture_output=True,
                           text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                           env=_env(tmp_path, CODEX_HOME=str(home), MOETIER_API_KEY="unused"))
        said = f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
        # Codex understood the stream: it printed the model's text under "codex" and reports no error
        # but the answer's length (an incomplete response, status and reason as the Responses API sends).
        assert "\ncodex\n" in r.stderr and r.stderr.split("\ncodex\n", 1)[1].strip(), said
        errors = {line for line in r.stderr.splitlines() if line.startswith("ERROR")}
        assert errors <= {too_long}, said
        if not errors:
            break
        assert r.returncode != 0, said  # an answer cut at its length is a failed turn for Codex
    _exit_zero_needs_an_ending_model(cluster, errors)
    if errors:
        pytest.skip(f"each of {CODEX_TRIES} answers of the demo model to Codex's prompt ran to the length "
                    f"({ANSWER_TOKENS} tokens; Codex exited non-zero with '{too_long}'): exit 0 needs an answer "
                    "that ends")
    assert r.returncode == 0, said
    assert r.stdout.strip(), r.stderr[-3000:]  # the model's last message


def test_claude_code_print(cluster: Up, tmp_path: Path) -> None:
    claude = _cli("claude")
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path, ANTHROPIC_BASE_URL=cluster.url, ANTHROPIC_AUTH_TOKEN="unused", ANTHROPIC_MODEL=MODEL,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(ANSWER_TOKENS))
    r = subprocess.run([claude, "-p", "Say hello.", "--system-prompt", "You are a coding agent. Answer briefly.",
                        "--tools", ""], cwd=work, capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env)
    said = f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    # Claude Code understood the stream: an answer it did not take is one that hit the length
    # it asked for (stop_reason max_tokens), nothing else.
    too_long = f"exceeded the {ANSWER_TOKENS} output token maximum"
    if r.returncode != 0:
        assert too_long in r.stdout, said
    _exit_zero_needs_an_ending_model(cluster, {too_long} if too_long in r.stdout else set())
    assert r.returncode == 0, said
    assert r.stdout.strip(), r.stderr[-3000:]


def _exit_zero_needs_an_ending_model(cluster: Up, length_errors: set[str]) -> None:
    """A CLI exits 0 only on an answer that ended. The synthetic (random) demo model never ends
    one by itself: on it an answer cut at its length is skipped with the reason, not passed."""
    source = json.loads((cluster.config.parent / "data" / "models" / MODEL / "moetier.json").read_text())["source"]
    if length_errors and source.get("kind") == "synth":
        pytest.skip(f"the demo container is random (source kind 'synth'): its answers never end, "
                    f"so the CLI stopped at the length ({sorted(length_errors)[0]}); exit 0 needs a model "
                    "that ends its answers")


# ---- the SDKs on the real model ----------------------------------------------------------
def test_anthropic_sdk(cluster: Up) -> None:
    c = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)
    m = c.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    with c.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY,
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
SCHEMA_COUNT = 52


@settings(max_examples=1, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(SCHEMAS, min_size=SCHEMA_COUNT, max_size=SCHEMA_COUNT))
def test_generated_schemas_validate_on_the_demo_model(cluster: Up, schemas: list[dict[str, Any]]) -> None:
    """52 schemas at once, 8 in flight (the dense worker batches them), each through one of the
    four constrained paths in turn."""
    def one(i: int) -> None:
        schema = schemas[i]
        try:
            jsonschema.validate(_constrained(cluster, APIS[i % len(APIS)], schema, i), schema)
        except Exception as e:
            raise AssertionError(f"schema {i} via {APIS[i % len(APIS)]}: {json.dumps(schema)}: {e}") from e

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(schemas))))
