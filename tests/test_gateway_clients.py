"""The three chat APIs through the official SDKs (`anthropic`, `openai`) against the gateway
served by uvicorn, a scripted router behind it: Anthropic Messages (create, stream, a tool
round trip), OpenAI Responses (create, stream, a function call round trip), chat with tools
(streamed and not), and what reaches the worker (the rendered tools, the grammar of a
forced call)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from helpers_gateway import MODEL, REPLY, Served, make_model_dir, reply_script, served

from moetier.rpc.v1 import generate_pb2
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(90)

WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    d = make_model_dir(tmp_path_factory.mktemp("models"))
    (d / "moetier.json").write_text(json.dumps({"model": {"max_position_embeddings": 4096}}))
    return ServedModel.from_dir(d)


@pytest.fixture(scope="module")
def server(model: ServedModel) -> Iterator[Served]:
    with served(model) as s:
        yield s


@pytest.fixture
def gw(server: Served, model: ServedModel) -> Served:
    """The router answers with a tool call while the prompt offers tools and holds no tool result,
    then with ANSWER; without tools with REPLY."""
    server.fake.reset()
    tok = model.tokenizer

    def script(r: generate_pb2.GenerateRequest) -> list[object]:
        prompt = tok.decode(list(r.prompt_ids), skip_special_tokens=False)
        if "<tools>" not in prompt:
            return reply_script(tok, max_tokens=r.sampling.max_tokens)  # type: ignore[return-value]
        text = ANSWER if "<tool_response>" in prompt else CALL_TEXT
        return reply_script(tok, text, max_tokens=r.sampling.max_tokens)  # type: ignore[return-value]

    server.fake.script = script  # type: ignore[assignment]
    return server


def _prompt(gw: Served, model: ServedModel, i: int = -1) -> str:
    return model.tokenizer.decode(list(gw.fake.requests[i].prompt_ids), skip_special_tokens=False)


# ---- Anthropic Messages ------------------------------------------------------------------
@pytest.fixture
def claude(gw: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=10)


ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER["parameters"]}


def test_anthropic_create(claude: anthropic.Anthropic, gw: Served, model: ServedModel) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=100, system="Be brief.",
                               messages=[{"role": "user", "content": "Say hello."}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == REPLY  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == len(gw.fake.requests[-1].prompt_ids) and m.usage.output_tokens > 3
    assert m.usage.cache_read_input_tokens == 0
    assert _prompt(gw, model).startswith("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nSay hello.")


def test_anthropic_system_messages_between_turns(claude: anthropic.Anthropic, gw: Served, model: ServedModel) -> None:
    """Claude Code sends its environment as a system message after the user's."""
    claude.messages.create(model=MODEL, max_tokens=5, system=[{"type": "text", "text": "Be brief."}],
                           messages=[{"role": "user", "content": "Hi"},
                                     {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}])  # type: ignore[misc,list-item]
    assert "<|user|>\nHi<|end|>\n<|system|>\n# Environment<|end|>\n<|assistant|>\n" in _prompt(gw, model)


def test_anthropic_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    assert final.content[0].text == REPLY and final.stop_reason == "end_turn"  # type: ignore[union-attr]


def test_anthropic_stop_sequence_and_max_tokens(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=100, stop_sequences=["world"],
                               messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "world"
    assert m.content[0].text == REPLY[: REPLY.index("world")]  # type: ignore[union-attr]
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_round_trip(claude: anthropic.Anthropic, gw: Served, model: ServedModel,
                                   stream: bool) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": MODEL, "max_tokens": 200, "tools": [ANTHROPIC_TOOL]}
    if stream:
        with claude.messages.stream(messages=ask, **kw) as s:  # type: ignore[arg-type]
            m = s.get_final_message()
    else:
        m = claude.messages.create(messages=ask, **kw)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].input == {"city": "Paris"}
    assert use[0].id.startswith("toolu_")
    assert '"name": "get_weather"' in _prompt(gw, model)  # the tools reached the template
    follow = [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny"}]}]
    answer = claude.messages.create(messages=follow, **kw)  # type: ignore[arg-type]
    assert answer.stop_reason == "end_turn" and answer.content[0].text == ANSWER  # type: ignore[union-attr]
    prompt = _prompt(gw, model)
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and CALL_TEXT in prompt


def test_anthropic_forced_tool_sends_a_grammar(claude: anthropic.Anthropic, gw: Served) -> None:
    claude.messages.create(model=MODEL, max_tokens=200, tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather?"}])
    grammar = gw.fake.requests[-1].sampling.grammar
    assert "<tool_call>" in grammar and "get_weather" in grammar
    claude.messages.create(model=MODEL, max_tokens=200, tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
                           messages=[{"role": "user", "content": "Weather?"}])
    assert not gw.fake.requests[-1].sampling.HasField("grammar")  # auto: unconstrained


def test_anthropic_count_tokens(claude: anthropic.Anthropic, gw: Served) -> None:
    n = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Say hello."}])
    claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Say hello."}])
    assert n.input_tokens == len(gw.fake.requests[-1].prompt_ids)
    with_tools = claude.messages.count_tokens(model=MODEL, tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
                                              messages=[{"role": "user", "content": "Say hello."}])
    assert with_tools.input_tokens > n.input_tokens + 20


# ---- OpenAI Responses --------------------------------------------------------------------
@pytest.fixture
def client(gw: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10)


RESPONSES_TOOL = {"type": "function", **WEATHER}


def test_responses_create(client: openai.OpenAI, gw: Served, model: ServedModel) -> None:
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Say hello.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == REPLY
    assert r.usage is not None and r.usage.input_tokens == len(gw.fake.requests[-1].prompt_ids)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert _prompt(gw, model).startswith("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nSay hello.")


def test_responses_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY  # type: ignore[union-attr]
    assert events[-1].response.output_text == REPLY  # type: ignore[union-attr]


def test_responses_incomplete(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True, max_output_tokens=2))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(client: openai.OpenAI, stream: bool) -> None:
    ask: list[object] = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    if stream:
        events = list(client.responses.create(model=MODEL, input=ask, tools=[RESPONSES_TOOL], stream=True))  # type: ignore[list-item,arg-type]
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        output = events[-1].response.output  # type: ignore[union-attr]
    else:
        output = client.responses.create(model=MODEL, input=ask, tools=[RESPONSES_TOOL]).output  # type: ignore[list-item,arg-type]
    calls = [o for o in output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    follow = [*ask, {"type": "reasoning", "id": "rs_1", "summary": []}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    r = client.responses.create(model=MODEL, input=follow, tools=[RESPONSES_TOOL])  # type: ignore[list-item,arg-type]
    assert r.output_text == ANSWER


def test_responses_namespace_tools_are_function_tools(client: openai.OpenAI) -> None:
    ns = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [RESPONSES_TOOL]}
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[ns])  # type: ignore[list-item]
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather"


# ---- chat completions with tools ---------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_round_trip(client: openai.OpenAI, gw: Served, model: ServedModel, stream: bool) -> None:
    ask: list[object] = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": WEATHER}]
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=tools, stream=True))  # type: ignore[arg-type]
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].type == "function"
        call_id, name, args = deltas[0].id, deltas[0].function.name, deltas[0].function.arguments  # type: ignore[union-attr]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = client.chat.completions.create(model=MODEL, messages=ask, tools=tools)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        tc = r.choices[0].message.tool_calls
        assert tc is not None and len(tc) == 1
        call_id, name, args = tc[0].id, tc[0].function.name, tc[0].function.arguments  # type: ignore[union-attr]
    assert name == "get_weather" and json.loads(args or "") == {"city": "Paris"} and call_id
    follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=tools)  # type: ignore[arg-type]
    assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
    assert "<tool_response>\nsunny\n</tool_response>" in _prompt(gw, model)


def test_chat_structured_outputs_send_grammars(client: openai.OpenAI, gw: Served) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "n?"}],
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert '"n"' in gw.fake.requests[-1].sampling.grammar
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "n?"}],
                                   response_format={"type": "json_object"})
    assert gw.fake.requests[-1].sampling.HasField("grammar")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "n?"}],
                                   tools=[{"type": "function", "function": WEATHER}], tool_choice="required")
    assert "get_weather" in gw.fake.requests[-1].sampling.grammar


def test_api_key_as_x_api_key(model: ServedModel) -> None:
    with served(model, api_key="sesame") as s:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sesame", max_retries=0, timeout=10)
        assert ok.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]).content
        r = httpx.post(f"{s.url}/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []},
                       headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"})
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Incorrect API key provided."}}
        bearer = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sesame", max_retries=0, timeout=10)
        assert bearer.responses.create(model=MODEL, input="Hi").output_text == REPLY

