"""The interface every tool-call format implements, and the streaming parser they share.

A format knows three things about its model family's tool calls: the marker that opens
them (`start`), how to read the complete calls out of the text from that marker on
(`calls`), and the Lark grammar of one call (`call_lark`), for forced tool calls under
structured outputs. `ToolStream` does the rest for every format, per request: text before
the marker streams as text (a possible partial marker is held back, as stop strings are),
and each call is emitted whole as soon as the format sees it complete. When the output
ends with a region that holds no valid call (a model that wrote the marker and then
something else), that region is returned as text: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moetier.text.conversation import CallDelta, Event, TextDelta, ToolCall, ToolDef, call_id
from moetier.text.grammar import lark_json, lark_literal

# How a grammar refers to a marker: a literal string, or (for a marker that is one special
# token of the tokenizer, which plain text never matches) that token, `<[id]>`.
Marker = Callable[[str], str]


def literal_marker(text: str) -> str:
    return lark_literal(text)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str | None = None  # formats that carry an id (Kimi K2)


def arguments_text(value: Any) -> str:
    """Arguments as the JSON text of an object: a dict is dumped, a string kept if it is JSON."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def decode_json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of text (after whitespace) and where it ends, or None."""
    stripped = len(text) - len(text.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, stripped)
    except ValueError:
        return None
    return value, end


class ToolFormat(ABC):
    name: str = ""
    start: str = ""  # the marker that opens the tool calls
    markers: tuple[str, ...] = ()  # every marker of the format (for special-token lookups)

    @abstractmethod
    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        """The complete calls in `region` (text from `start` on); `final`: the output ended."""

    @abstractmethod
    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        """A Lark expression of one complete call of `tool`."""

    def forced_lark(self, tools: Sequence[ToolDef], marker: Marker) -> str:
        """The Lark grammar of an answer that is exactly one call of one of `tools`."""
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = "\n".join(f"call_{i}: {self.call_lark(t, marker)}" for i, t in enumerate(tools))
        return f"start: {alternatives}\n{rules}\n"


def schema_of(tool: ToolDef) -> dict[str, Any]:
    return tool.parameters or {"type": "object"}


def name_and_args_lark(tool: ToolDef) -> str:
    """{"name": "<tool>", "arguments": {...}} as a %json expression (Hermes, Mistral v3)."""
    return lark_json({"type": "object", "properties": {"name": {"const": tool.name}, "arguments": schema_of(tool)},
                      "required": ["name", "arguments"], "additionalProperties": False})


class ToolStream:
    """One response's tool-call parsing, fed text as it is generated."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[ToolDef], id_prefix: str = "call_") -> None:
        self.fmt = fmt
        self.tools = list(tools)
        self.id_prefix = id_prefix
        self._held = ""  # text state: a suffix that may be the beginning of fmt.start
        self._region: str | None = None  # from fmt.start on, once seen
        self._emitted = 0  # calls already returned
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        if self._region is not None:
            self._region += text
            return self._new_calls(final=False)
        buf = self._held + text
        at = buf.find(self.fmt.start)
        if at >= 0:
            self._held = ""
            self._region = buf[at:]
            out: list[Event] = [TextDelta(buf[:at])] if buf[:at] else []
            return out + self._new_calls(final=False)
        keep = _partial_tail(buf, self.fmt.start)
        self._held = buf[len(buf) - keep :]
        emit = buf[: len(buf) - keep]
        return [TextDelta(emit)] if emit else []

    def close(self) -> list[Event]:
        if self._region is None:
            held, self._held = self._held, ""
            return [TextDelta(held)] if held else []
        out = self._new_calls(final=True)
        if not self.calls:
            return [TextDelta(self._region)]  # no valid call: the model's words are text
        return out

    def _new_calls(self, final: bool) -> list[Event]:
        assert self._region is not None
        parsed = self.fmt.calls(self._region, final, self.tools)
        out: list[Event] = []
        for p in parsed[self._emitted :]:
            call = ToolCall(id=p.id or call_id(self.id_prefix), name=p.name, arguments=p.arguments)
            out.append(CallDelta(len(self.calls), call))
            self.calls.append(call)
        self._emitted = len(parsed)
        return out


def _partial_tail(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0
