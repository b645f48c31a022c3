"""The OpenAI wire format: request models in the order of the official API reference,
with their constraints, and the response bodies. `to_sampling_params()` is the one place a
request becomes engine parameters (proto SamplingParams).

Supported: n = 1 (others are rejected), no logit_bias, no suffix. `top_k` is an extension
(0 = off). Unknown fields are ignored, as OpenAI-compatible servers do. Chat requests
become the gateway's one internal `Conversation` (`to_conversation`): tools, tool
choice, assistant tool calls, tool results and the response format included.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from moetier.rpc.v1 import generate_pb2
from moetier.text.conversation import Conversation, Message, ToolCall, ToolChoice, ToolDef

U32 = 2**31 - 1  # bound for values that travel as uint32 (kept within int32 too)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is the rest of the context)
U64 = 2**64 - 1
# Count limits, checked while the body is parsed (400 before any work starts). With
# gateway.max_body_bytes they bound what one request can ask of the cluster (docs/security.md).
MAX_MESSAGES = 4096  # messages (Chat, Messages) or input items (Responses) per request
MAX_TOOLS = 128  # tools per request (OpenAI's limit)
MAX_STOPS = 4  # stop strings (OpenAI's limit; Anthropic's stop_sequences: MAX_STOP_SEQUENCES)
MAX_STOP_SEQUENCES = 16
TokenId = Annotated[int, Field(ge=0, le=U32)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class MediaPart(_Wire):
    """Image, audio and file parts: refused with a 400 naming the part (the served models read
    text only; a multimodal checkpoint's vision tower is not converted)."""

    type: Literal["image_url", "input_audio", "file"]

    @model_validator(mode="after")
    def _refuse(self) -> MediaPart:
        raise ValueError(f"{self.type} parts are not supported (this model reads text only)")


ChatPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionCall(_Wire):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ChatToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is rendered as `system`.")
    content: str | list[ChatPart] | None = Field(
        None, description="A string, or text parts (joined with newlines); may be null on an assistant "
        "message with tool_calls.")
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = Field(None, description="Assistant messages: the calls it made.")
    tool_call_id: str | None = Field(None, description="Tool messages: the call this is the result of.")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def for_template(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class FunctionDef(_Wire):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments (an object).")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class ChatTool(_Wire):
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDef


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Wire):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        return self

    def schema_or_mode(self) -> dict[str, Any] | Literal["json_object"] | None:
        if self.type == "json_object":
            return "json_object"
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ or {}
        return None


def tool_defs(tools: list[ChatTool] | None) -> list[ToolDef]:
    out = [ToolDef(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
           for t in tools or []]
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return out


class StreamOptions(_Wire):
    include_usage: bool = Field(False, description="Send a last chunk with usage and empty choices.")


Stop = Annotated[list[str], Field(max_length=MAX_STOPS)] | str | None


def _stop_list(stop: list[str] | str | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _sampling(r: ChatCompletionRequest | CompletionRequest, *, max_tokens: int, stop_token_ids: tuple[int, ...],
              logprobs: bool, top_logprobs: int, default_temperature: float) -> generate_pb2.SamplingParams:
    p = generate_pb2.SamplingParams(
        temperature=r.temperature if r.temperature is not None else default_temperature,
        top_p=r.top_p if r.top_p is not None else 1.0,
        top_k=r.top_k or 0,
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if r.seed is not None:
        p.seed = r.seed
    return p


class _Common(_Wire):
    """Checks shared by both endpoints; the messages name the field."""

    @field_validator("n", check_fields=False)
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> Any:
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")
    logprobs: bool | None = Field(False, description="Return the log-probability of each output token.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (wins over it).")
    max_tokens: int | None = Field(None, ge=1, description="Default (absent or null): the rest of the context.")
    n: int | None = Field(1, description="Only 1.")
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=U64)
    stop: Stop = Field(None, description="Up to 4 strings; the text stops before the first one.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default: "
                                      "gateway.default_temperature (1.0).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Needs logprobs=true.")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=U32, description="Extension: keep the k most likely tokens (0 = off).")
    user: str | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS,
                                         description="Function tools, rendered by the model's chat template.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without. required / named: exactly one call, "
        "its arguments constrained to the tool's schema.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call is returned.")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the answer is "
                                                   "decoded under that grammar.")

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        tool_defs(self.tools)
        return self

    def to_conversation(self) -> Conversation:
        tools = tool_defs(self.tools)
        choice = self.tool_choice or ("auto" if tools else "none")
        messages = []
        names: dict[str, str] = {}  # call id -> tool name, for the tool messages answering it
        for m in self.messages:
            calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
            names.update((c.id, c.name) for c in calls)
            role = "system" if m.role == "developer" else m.role
            name = (m.name or names.get(m.tool_call_id or "")) if m.role == "tool" else None
            messages.append(Message(role=role, content=m.text, tool_calls=calls, tool_call_id=m.tool_call_id,
                                    name=name))
        return Conversation(
            messages=messages, tools=tools,
            tool_choice=ToolChoice("named", choice.function.name) if isinstance(choice, NamedToolChoice)
            else ToolChoice(choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_schema=self.response_format.schema_or_mode() if self.response_format else None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stops(self) -> list[str]:
        return _stop_list(self.stop)

    def to_sampling_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...],
                           default_temperature: float = 1.0) -> generate_pb2.SamplingParams:
        return _sampling(self, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                         default_temperature=default_temperature, logprobs=bool(self.logprobs),
                         top_logprobs=(self.top_logprobs or 0) if self.logprobs else 0)


class CompletionRequest(_Common):
    model: str
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A string or token ids; a list of several prompts is not supported.")
    best_of: int | None = Field(None, ge=1, le=1, description="Only 1.")
    echo: bool | None = Field(False, description="Return the prompt before the completion.")
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return logprobs and this many alternatives.")
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=1, description="Default 16; null means the default.")
    n: int | None = Field(1, description="Only 1.")
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=U64)
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = Field(None, description="Not supported: must be empty.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default: gateway.default_temperature (1.0).")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=U32, description="Extension: keep the k most likely tokens (0 = off).")
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, p: str | list[Any]) -> str | list[Any]:
        if isinstance(p, list) and not p:
            raise ValueError("the prompt is empty")
        if isinstance(p, list) and isinstance(p[0], str | list) and len(p) != 1:
            raise ValueError("a batch of prompts is not supported (send one per request)")
        return p

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        # An explicit null is the default, as when the field is absent (not the rest of the context).
        return COMPLETION_MAX_TOKENS if v is None else v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p  # type: ignore[return-value]

    @property
    def stops(self) -> list[str]:
        return _stop_list(self.stop)

    def to_sampling_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...],
                           default_temperature: float = 1.0) -> generate_pb2.SamplingParams:
        return _sampling(self, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                         default_temperature=default_temperature,
                         logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0)


# ---- responses ---------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the dense worker's prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ChatToolCall] | None = Field(None, description="Present when the answer made tool calls.")

    @model_serializer(mode="wrap")
    def _drop_absent_calls(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moetier"
    max_model_len: int = Field(description="Extension: prompt + completion tokens the gateway accepts.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
