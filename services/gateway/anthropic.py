"""The Anthropic Messages API (what Claude Code speaks): POST /v1/messages and
/v1/messages/count_tokens, as the official `anthropic` SDK's types define them, over the
gateway's one Conversation (services.gateway.chat).

Request content is a string or blocks: `text`, `tool_use`, `tool_result` (a string or text
blocks); `thinking` / `redacted_thinking` blocks of earlier turns are skipped; `image` and
`document` are a 400. `thinking` ({"type": "enabled" | "adaptive" | "disabled"}) reaches the
chat template as `enable_thinking` / `thinking` (templates without them ignore it). Tools
are custom tools (`name`, `description`, `input_schema`); a server tool (a `type` other
than "custom") is a 400. `tool_choice` auto / any / tool / none; any and tool force one call
whose input matches the tool's schema. `output_config.format` ({"type": "json_schema",
"schema"}) constrains the text to the schema.

Usage follows Anthropic's arithmetic: input_tokens + cache_read_input_tokens is the whole
prompt, cache_read_input_tokens being the prompt tokens the dense worker served from its
prefix cache. Errors: Anthropic's envelope (services.gateway.errors.anthropic_error).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetier.text.conversation import CallDelta, Conversation, Event, Message, ToolCall, ToolChoice, ToolDef
from services.gateway.chat import ChatRun, Options, complete_run, new_id, stream_run
from services.gateway.engine import Piece
from services.gateway.errors import APIError, anthropic_error
from services.gateway.protocol import MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_TOOLS
from services.gateway.router_client import Token

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------
class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(_Wire):
    type: Literal["thinking", "redacted_thinking"]


class UnsupportedBlock(_Wire):
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload"]

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedBlock:
        raise ValueError(f"{self.type} content blocks are not supported (this model reads text only)")


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnsupportedBlock,
                  Field(discriminator="type")]


class MessageParam(_Wire):
    role: Literal["user", "assistant", "system"] = Field(
        description="system: instructions between turns (as Claude Code sends its environment).")
    content: str | list[Block]


class Tool(_Wire):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceParam(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs a name")
        return self


class ThinkingParam(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class JsonOutputFormat(_Wire):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Wire):
    format: JsonOutputFormat | None = None


class Metadata(_Wire):
    user_id: str | None = None


class CountTokensRequest(_Wire):
    model: str
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if self.tool_choice and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice.type} needs tools")
        return self

    def to_conversation(self) -> Conversation:
        messages: list[Message] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append(Message("system", text))
        names: dict[str, str] = {}
        for m in self.messages:
            messages.extend(_messages(m, names))
        choice = self.tool_choice
        mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice.type] if choice else (
            "auto" if self.tools else "none")
        fmt = self.output_config.format if self.output_config else None
        return Conversation(
            messages=messages,
            tools=[ToolDef(t.name, t.description, t.input_schema) for t in self.tools or []],
            tool_choice=ToolChoice(mode, choice.name if choice and choice.type == "tool" else None),  # type: ignore[arg-type]
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
            response_schema=fmt.schema_ if fmt else None,
            thinking=None if self.thinking is None else self.thinking.type != "disabled")


def _messages(m: MessageParam, names: dict[str, str]) -> list[Message]:
    """One Anthropic message as template messages: tool results become tool messages (in
    order), the rest of a turn's text one message; tool_use blocks its calls."""
    if isinstance(m.content, str):
        return [Message(m.role, m.content)]
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for b in m.content:
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)))
            names[b.id] = b.name
        elif isinstance(b, ToolResultBlock):
            text = ("Error: " if b.is_error else "") + b.text
            out.append(Message("tool", text, tool_call_id=b.tool_use_id, name=names.get(b.tool_use_id)))
    if texts or calls or not out:
        out.append(Message(m.role, "\n".join(texts), tool_calls=calls))
    return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)

    def options(self) -> Options:
        return Options(max_tokens=self.max_tokens, temperature=self.temperature,
                       top_p=self.top_p or 1.0, top_k=self.top_k or 0, stops=list(self.stop_sequences or []))


# ---- responses ---------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int


class MessageBody(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail


def _sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessagesFormat:
    """The Messages API over a ChatRun (services.gateway.chat.RunFormat)."""

    def __init__(self, id: str, model: str) -> None:
        self.id = id
        self.model = model
        self._block: Literal["text", "tool_use"] | None = None  # the open content block
        self._index = -1

    def _stop(self, run: ChatRun) -> tuple[str | None, str | None]:
        seq = run.gen.stop_sequence
        if seq is not None and run.finish_reason == "stop":
            return "stop_sequence", seq
        return STOP_REASONS.get(run.finish_reason or ""), None

    def _usage(self, run: ChatRun) -> Usage:
        u = run.usage()
        return Usage(input_tokens=u.prompt_tokens - u.cached_tokens, output_tokens=u.completion_tokens,
                     cache_read_input_tokens=u.cached_tokens)

    def start(self, run: ChatRun) -> list[str]:
        usage = self._usage(run).model_dump()
        usage["output_tokens"] = 0
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [_sse("message_start", {"type": "message_start", "message": message}), _sse("ping", {"type": "ping"})]

    def _open(self, kind: Literal["text", "tool_use"], block: dict[str, Any]) -> list[str]:
        out = self._close()
        self._index += 1
        self._block = kind
        return [*out, _sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                   "content_block": block})]

    def _close(self) -> list[str]:
        if self._block is None:
            return []
        self._block = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def events(self, run: ChatRun, piece: Piece, events: list[Event]) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, CallDelta):
                out += self._open("tool_use", {"type": "tool_use", "id": e.call.id, "name": e.call.name, "input": {}})
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": e.call.arguments}}))
                out += self._close()
            elif e.text:
                if self._block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                        "delta": {"type": "text_delta", "text": e.text}}))
        return out

    def end(self, run: ChatRun) -> list[str]:
        out = self._close()
        if self._index < 0:  # an empty answer still has its (empty) text block
            out += self._open("text", {"type": "text", "text": ""}) + self._close()
        reason, seq = self._stop(run)
        u = self._usage(run)
        out.append(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": seq},
                                          "usage": {"output_tokens": u.output_tokens,
                                                    "input_tokens": u.input_tokens,
                                                    "cache_read_input_tokens": u.cache_read_input_tokens}}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out

    def error(self, run: ChatRun, err: APIError) -> list[str]:
        return [_sse("error", anthropic_error(err)[1])]

    def body(self, run: ChatRun, tokens: list[Token]) -> MessageBody:
        content: list[dict[str, Any]] = [{"type": "text", "text": run.text}] if run.text or not run.calls else []
        for c in run.calls:
            value = c.arguments_value()
            content.append({"type": "tool_use", "id": c.id, "name": c.name,
                            "input": value if isinstance(value, dict) else {}})
        reason, seq = self._stop(run)
        return MessageBody(id=self.id, content=content, model=self.model, stop_reason=reason,
                           stop_sequence=seq, usage=self._usage(run))


# ---- routes ------------------------------------------------------------------------------
def _gateway(request: Request) -> Any:
    return request.app.state.gateway


GatewayDep = Annotated[Any, Depends(_gateway)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": what} for code, what in [
        (400, "invalid_request_error: invalid request, or the prompt does not fit the context"),
        (401, "authentication_error: missing or wrong API key"),
        (404, "not_found_error: unknown model"),
        (413, "request_too_large: request body too large"),
        (429, "rate_limit_error: the cluster's queues are full"),
        (500, "api_error: internal error"),
        (529, "overloaded_error: no dense worker serves, or the router is unreachable"),
    ]
}
router = APIRouter()


@router.post("/v1/messages", response_model=MessageBody, responses={
    **_ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "The message, or with stream=true Anthropic's server-sent events"}})
async def messages(body: MessagesRequest, request: Request, gw: GatewayDep) -> Any:
    gw.check_model(body.model)
    request_id = new_id("msg_")
    run = await ChatRun.start(gw, body.to_conversation(), body.options(), request_id, param="messages",
                              call_id_prefix="toolu_")
    fmt = MessagesFormat(request_id, gw.model.name)
    if body.stream:
        return await stream_run(request, run, fmt)
    return await complete_run(request, run, fmt)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, gw: GatewayDep) -> CountTokensResponse:
    gw.check_model(body.model)
    n = await ChatRun.count_tokens(gw, body.to_conversation(), param="messages")
    return CountTokensResponse(input_tokens=n)
