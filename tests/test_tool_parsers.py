"""Tool-call formats: real-format strings of each model family, parsed whole and streamed in
chunks split at every position (partial markers across chunks); choosing the format."""

from __future__ import annotations

import json

import pytest

from moetier.errors import InvalidArgument
from moetier.text.conversation import CallDelta, TextDelta, ToolDef
from moetier.text.tools import FORMATS, ToolStream, choose_format, tool_format

WEATHER = ToolDef("get_weather", "Weather of a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})
TIME = ToolDef("get_time", None, {"type": "object", "properties": {"zone": {"type": "string"}}})
TOOLS = [WEATHER, TIME]

# (format, model output, text before the calls, [(name, arguments)])
CASES = [
    ("qwen3", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]),
    ("glm45", "I will look it up.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
     "I will look it up.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value></tool_call>"
              "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>",
     "", [("get_weather", {"city": "123"}), ("get_time", {"zone": "UTC"})]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                    '```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 1}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", [("get_weather", {"city": "Oslo", "days": 1})]),
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"zone": "CST"}<|tool_call_end|>'
                "<|tool_calls_section_end|>",
     "Checking.", [("get_weather", {"city": "Beijing"}), ("get_time", {"zone": "CST"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]',
     "", [("get_weather", {"city": "Lyon"}), ("get_time", {"zone": "CET"})]),
    ("mistral", 'Okay. [TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 3}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
                '[ARGS]{"zone": "CET"}',
     "Okay. ", [("get_weather", {"city": "Nice", "days": 3}), ("get_time", {"zone": "CET"})]),
]


def _run(fmt: str, chunks: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]], list[int]]:
    s = ToolStream(tool_format(fmt), TOOLS)
    events = [e for c in chunks for e in s.feed(c)] + s.close()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [e for e in events if isinstance(e, CallDelta)]
    return text, [(c.call.name, json.loads(c.call.arguments)) for c in calls], [c.index for c in calls]


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), CASES)
def test_whole_output(fmt: str, output: str, text: str, calls: list[tuple[str, dict[str, object]]]) -> None:
    got_text, got_calls, indexes = _run(fmt, [output])
    assert got_text == text
    assert got_calls == calls
    assert indexes == list(range(len(calls)))


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), CASES)
def test_split_at_every_position(fmt: str, output: str, text: str, calls: list[tuple[str, dict[str, object]]]) -> None:
    for i in range(1, len(output)):
        assert _run(fmt, [output[:i], output[i:]])[:2] == (text, calls), i
    assert _run(fmt, list(output))[:2] == (text, calls)  # one character at a time


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_plain_text_and_broken_calls_are_text(fmt: str) -> None:
    assert _run(fmt, ["Just ", "an answer ", "<tool", " with a <"]) == ("Just an answer <tool with a <", [], [])
    start = tool_format(fmt).start
    broken = f"Hmm {start} not a call at all"
    assert _run(fmt, [broken[:7], broken[7:]]) == (broken, [], [])


def test_calls_are_emitted_as_soon_as_complete() -> None:
    s = ToolStream(tool_format("qwen3"), TOOLS)
    first = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    events = s.feed(first)
    assert [e.call.name for e in events if isinstance(e, CallDelta)] == ["get_time"]
    assert s.feed("\n<tool_call>\n{") == []
    assert s.close() == []  # the second call never completed


def test_kimi_ids_are_the_models() -> None:
    s = ToolStream(tool_format("kimi_k2"), TOOLS)
    events = s.feed(CASES[5][1]) + s.close()
    assert [e.call.id for e in events if isinstance(e, CallDelta)] == ["functions.get_weather:0", "functions.get_time:1"]


def test_choose_format() -> None:
    glm = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ name }}<arg_key>"
    assert choose_format(glm, "glm4_moe").name == "glm45"
    assert choose_format("{% if tools %}<tool_call>{% endif %}", "deepseek_v3").name == "qwen3"
    assert choose_format("{% if tools %}<|tool_calls_section_begin|>{% endif %}", "deepseek_v3").name == "kimi_k2"
    assert choose_format("{{ tools }}<｜tool▁calls▁begin｜>", "deepseek_v3").name == "deepseek_v3"
    assert choose_format("{{ tools }}[TOOL_CALLS]", "mixtral").name == "mistral"
    assert choose_format("{{ tools }} unknown markers", "glm4_moe").name == "glm45"  # by architecture
    assert choose_format("{{ messages }} no tool support", "qwen3_moe") is None
    assert choose_format(None, "qwen3_moe") is None
    assert choose_format(None, None, override="mistral").name == "mistral"
    with pytest.raises(InvalidArgument, match="unknown tool-call format 'nope'"):
        choose_format(None, None, override="nope")
