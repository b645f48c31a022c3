"""The one internal representation of a conversation with tools, behind the three wire APIs
(OpenAI chat completions, OpenAI Responses, Anthropic Messages). Each wire format is a thin
layer that builds a `Conversation` and renders `Output` events back in its own shapes.

A conversation is what the model's chat template sees, in transformers' terms: messages
with roles system / user / assistant / tool, assistant messages carrying `tool_calls`
({"id", "type": "function", "function": {"name", "arguments"}}, arguments as a dict), tool
messages carrying `tool_call_id` and `name`, and the `tools` list
([{"type": "function", "function": {"name", "description", "parameters"}}]).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ToolMode = Literal["none", "auto", "required", "named"]


def call_id(prefix: str = "call_") -> str:
    """A fresh tool call id (letters and digits after the prefix)."""
    return prefix + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def for_template(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it (or the client sent it)

    def arguments_value(self) -> Any:
        """The arguments as a value (a dict when they are a JSON object, else the text)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments

    def for_template(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_value()}}


@dataclass
class Message:
    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # tool messages: the call this answers
    name: str | None = None  # tool messages: the tool's name (some templates print it)

    def for_template(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            m["name"] = self.name
        return m


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode = "auto"
    name: str | None = None  # mode "named"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[ToolDef] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    # Structured output of the answer's text: None (free text), "json_object" or a JSON schema.
    response_schema: dict[str, Any] | Literal["json_object"] | None = None
    thinking: bool | None = None  # None: the template's default

    def tool(self, name: str) -> ToolDef | None:
        return next((t for t in self.tools if t.name == name), None)

    def for_template(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) as transformers passes them to a chat template."""
        tools = [t.for_template() for t in self.tools] or None
        return [m.for_template() for m in self.messages], tools

    @property
    def parses_tools(self) -> bool:
        """Whether the output is searched for tool calls."""
        return bool(self.tools) and self.tool_choice.mode != "none"


# ---- what a generation produces, format-neutral ------------------------------------------
@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A complete tool call, the index-th of the answer."""

    index: int
    call: ToolCall


Event = TextDelta | CallDelta
