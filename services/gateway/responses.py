"""The OpenAI Responses API (what Codex speaks), stateless: POST /v1/responses as the
official `openai` SDK's types define it, over the gateway's one Conversation.

`input` is a string or items: `message` (role user / assistant / system / developer; a
string or `input_text` / `output_text` parts), `function_call`, `function_call_output`;
`reasoning` items are accepted and skipped. `instructions` is the system message. Tools
are `function` tools; any other type is a 400. `text.format` json_object / json_schema is
structured output. Nothing is stored: `store: true` is accepted as Codex sends it but means
nothing, and `previous_response_id` is a 400 (send the whole conversation; the prefix cache
makes its shared prefix cheap).

A stream is: response.created, response.in_progress, then per output item
response.output_item.added, for a message response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done, for a
function call response.function_call_arguments.delta / .done, then response.output_item.done,
and finally response.completed (or response.incomplete at max_output_tokens, response.failed
on an error). Every event carries its sequence_number.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetier.text.conversation import CallDelta, Conversation, Event, Message, ToolCall, ToolChoice, ToolDef
from services.gateway.chat import ChatRun, Options, complete_run, new_id, stream_run
from services.gateway.engine import Piece
from services.gateway.errors import APIError
from services.gateway.protocol import MAX_MESSAGES, MAX_TOOLS, ErrorResponse
from services.gateway.router_client import Token


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Wire):
    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(_Wire):
    type: Literal["input_image", "input_file", "input_audio", "refusal"]

    @model_validator(mode="after")
    def _refuse(self) -> OtherPart:
        if self.type != "refusal":
            raise ValueError(f"{self.type} parts are not supported (this model reads text only)")
        return self


Part = Annotated[TextPart | OtherPart, Field(discriminator="type")]


def _text(content: str | list[Part]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content if isinstance(p, TextPart))


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Wire):
    type: Literal["reasoning"]


def _item_type(v: Any) -> str:
    return str(v.get("type", "message")) if isinstance(v, dict) else "message"


class FunctionTool(_Wire):
    type: Literal["function"] = Field(description="Only function tools.")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    namespace: str | None = None  # set for the tools of a namespace tool


class NamedFunction(_Wire):
    type: Literal["function"]
    name: str


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] = Field(
        description="A string, or message / function_call / function_call_output / reasoning items.")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server keeps no responses (send the "
                             "whole conversation in input; its shared prefix comes from the prefix cache)")
        self.function_tools()
        self.items()
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input is empty")
        return self

    def function_tools(self) -> list[FunctionTool]:
        """The function tools, those inside `namespace` tools included (Codex groups some so)."""
        out = []
        for i, t in enumerate(self.tools or []):
            inner = t.get("tools") if t.get("type") == "namespace" else [t]
            for j, f in enumerate(inner if isinstance(inner, list) else []):
                where = f"tools[{i}]" + (f".tools[{j}]" if inner is not None and f is not t else "")
                if not isinstance(f, dict) or f.get("type") != "function":
                    kind = f.get("type") if isinstance(f, dict) else f
                    raise ValueError(f"{where}: tools of type {kind!r} are not supported (only function tools, "
                                     "also grouped in a namespace; hosted tools such as web_search need OpenAI)")
                tool = FunctionTool.model_validate(f)
                if t.get("type") == "namespace":
                    tool.namespace = str(t.get("name", ""))
                out.append(tool)
        names = [t.name for t in out]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return out

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        out: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem] = []
        kinds: dict[str, type[_Wire]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                         "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
        for i, item in enumerate(self.input):
            kind = kinds.get(_item_type(item))
            if kind is None:
                raise ValueError(f"input[{i}]: items of type {_item_type(item)!r} are not supported")
            out.append(kind.model_validate(item))  # type: ignore[arg-type]
        return out

    def to_conversation(self) -> Conversation:
        messages: list[Message] = [Message("system", self.instructions)] if self.instructions else []
        names: dict[str, str] = {}
        for item in self.items():
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append(Message(role, _text(item.content)))
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = ToolCall(item.call_id, item.name, item.arguments)
                if messages and messages[-1].role == "assistant":
                    messages[-1].tool_calls.append(call)  # parallel calls: one assistant turn
                else:
                    messages.append(Message("assistant", "", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(Message("tool", _text(item.output), tool_call_id=item.call_id,
                                        name=names.get(item.call_id)))
        tools = [ToolDef(t.name, t.description, t.parameters or {"type": "object"}) for t in self.function_tools()]
        choice = self.tool_choice or ("auto" if tools else "none")
        fmt = self.text.format if self.text else None
        schema: dict[str, Any] | Literal["json_object"] | None = None
        if fmt is not None and fmt.type != "text":
            schema = "json_object" if fmt.type == "json_object" else fmt.schema_
        return Conversation(messages=messages, tools=tools,
                            tool_choice=ToolChoice("named", choice.name) if isinstance(choice, NamedFunction)
                            else ToolChoice(choice),
                            parallel_tool_calls=self.parallel_tool_calls is not False, response_schema=schema)

    def options(self) -> Options:
        return Options(max_tokens=self.max_output_tokens,
                       temperature=self.temperature, top_p=self.top_p or 1.0)


class ResponseBody(BaseModel):
    """The response object (the fields Codex and the SDK read, in the reference's order)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    temperature: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    store: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: dict[str, Any] | None = None


class ResponsesFormat:
    """The Responses API over a ChatRun (services.gateway.chat.RunFormat)."""

    def __init__(self, id: str, model: str, body: ResponsesRequest) -> None:
        self.id = id
        self.model = model
        self.req = body
        self.created = int(time.time())
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # finished items
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""
        self._namespaces = {t.name: t.namespace for t in body.function_tools() if t.namespace}

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _response(self, status: str, run: ChatRun | None, output: list[dict[str, Any]],
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.req
        usage = None
        if run is not None and status != "in_progress":
            u = run.usage()
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        return ResponseBody(
            id=self.id, created_at=self.created, status=status, error=error,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=r.parallel_tool_calls is not False, temperature=r.temperature,
            tool_choice=r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else (r.tool_choice or "auto"),
            tools=r.tools or [], top_p=r.top_p, store=bool(r.store),
            text={"format": r.text.format.model_dump(by_alias=True, exclude_none=True)}
            if r.text and r.text.format else {"format": {"type": "text"}},
            usage=usage).model_dump()

    def _call_item(self, call: ToolCall, status: str, arguments: str) -> dict[str, Any]:
        item = {"id": new_id("fc_"), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": arguments}
        if ns := self._namespaces.get(call.name):
            item["namespace"] = ns
        return item

    def _status(self, run: ChatRun) -> str:
        return "incomplete" if run.finish_reason == "length" else "completed"

    # ---- stream ----
    def start(self, run: ChatRun) -> list[str]:
        r = self._response("in_progress", run, [])
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _open_message(self) -> list[str]:
        self._message = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
        self._text = ""
        index = len(self._output)
        return [self._event("response.output_item.added", output_index=index, item=self._message),
                self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _close_message(self, status: str) -> list[str]:
        if self._message is None:
            return []
        m, self._message = self._message, None
        index = len(self._output)
        part = {"type": "output_text", "text": self._text, "annotations": []}
        item = {**m, "status": status, "content": [part]}
        self._output.append(item)
        return [self._event("response.output_text.done", item_id=m["id"], output_index=index, content_index=0,
                            text=self._text, logprobs=[]),
                self._event("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def events(self, run: ChatRun, piece: Piece, events: list[Event]) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, CallDelta):
                out += self._close_message("completed")
                index = len(self._output)
                item = self._call_item(e.call, "in_progress", "")
                out.append(self._event("response.output_item.added", output_index=index, item=item))
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=e.call.arguments))
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=e.call.arguments))
                done = {**item, "status": "completed", "arguments": e.call.arguments}
                self._output.append(done)
                out.append(self._event("response.output_item.done", output_index=index, item=done))
            elif e.text:
                if self._message is None:
                    out += self._open_message()
                assert self._message is not None
                self._text += e.text
                out.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                       output_index=len(self._output), content_index=0, delta=e.text, logprobs=[]))
        return out

    def end(self, run: ChatRun) -> list[str]:
        status = self._status(run)
        out = self._close_message(status)
        if not self._output:  # an empty answer is still a message
            out += self._open_message() + self._close_message(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=self._response(status, run, self._output))]

    def error(self, run: ChatRun, err: APIError) -> list[str]:
        error = {"code": err.code or "server_error", "message": err.message}
        return [self._event("response.failed", response=self._response("failed", run, self._output, error))]

    # ---- body ----
    def body(self, run: ChatRun, tokens: list[Token]) -> dict[str, Any]:
        status = self._status(run)
        output: list[dict[str, Any]] = []
        if run.text or not run.calls:
            output.append({"id": new_id("msg_"), "type": "message", "status": status, "role": "assistant",
                           "content": [{"type": "output_text", "text": run.text, "annotations": []}]})
        for c in run.calls:
            output.append(self._call_item(c, "completed", c.arguments))
        return self._response(status, run, output)


def _gateway(request: Request) -> Any:
    return request.app.state.gateway


GatewayDep = Annotated[Any, Depends(_gateway)]
router = APIRouter()


@router.post("/v1/responses", response_model=ResponseBody, responses={
    **{code: {"model": ErrorResponse, "description": what} for code, what in [
        (400, "Invalid request, or the prompt does not fit the context"), (401, "Missing or wrong API key"),
        (404, "Unknown model"), (413, "Request body too large"), (429, "The cluster's queues are full"),
        (503, "No dense worker serves, or the router is unreachable")]},
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "The response, or with stream=true the Responses API's server-sent events"}})
async def responses(body: ResponsesRequest, request: Request, gw: GatewayDep) -> Any:
    gw.check_model(body.model)
    request_id = new_id("resp_")
    run = await ChatRun.start(gw, body.to_conversation(), body.options(), request_id, param="input")
    fmt = ResponsesFormat(request_id, gw.model.name, body)
    if body.stream:
        return await stream_run(request, run, fmt)
    return await complete_run(request, run, fmt)
