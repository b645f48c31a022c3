"""The conversation pipeline behind the three chat APIs (OpenAI chat completions, OpenAI
Responses, Anthropic Messages). Each wire format builds a `Conversation` and `Options`,
then reads one `ChatRun`:

    run = await ChatRun.start(gw, conversation, options, request_id, param="messages")
    async for piece, events in run.pieces(): ...   # text deltas and complete tool calls
    run.finish_reason, run.calls, run.usage()

Start-up does, in order: the model's chat template renders the messages and tools
(a template that renders no tools refuses a request with tools), the prompt is tokenized
and sized against the context (the API's own context-length error up front), and a
grammar is built and checked when the answer is constrained: a forced tool call
(`required` / named, Anthropic `any` / `tool`) is exactly one call in the model family's
own tool-call syntax with arguments matching the tool's schema; `json_object` /
`json_schema` is JSON matching the schema. The dense worker applies the grammar as a token
mask. The output is parsed for tool calls with the model family's format (ToolStream).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from moetier.errors import InvalidArgument, MoetierError
from moetier.rpc.v1 import generate_pb2
from moetier.text.conversation import CallDelta, Conversation, Event, TextDelta, ToolCall, ToolDef
from moetier.text.grammar import fit_schema, json_schema_grammar, lark_grammar, lark_literal
from moetier.text.tools import ToolFormat, ToolStream
from services.gateway.engine import Generation, Piece
from services.gateway.errors import APIError, from_moetier
from services.gateway.router_client import Token
from services.gateway.sse import EventStream, cancel_on_disconnect

if TYPE_CHECKING:
    from services.gateway.api import Gateway

log = logging.getLogger(__name__)

GRAMMAR_RESERVE = 48  # tokens of a constrained answer kept for a tool call's wrapper and the stop token


@dataclass(frozen=True)
class Options:
    """Sampling and length options, whichever API they came from."""

    max_tokens: int | None = None  # None: the rest of the context
    temperature: float | None = None  # None: gateway.default_temperature
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stops: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0

    def sampling(self, max_tokens: int, stop_token_ids: tuple[int, ...], grammar: str | None,
                 default_temperature: float = 1.0) -> generate_pb2.SamplingParams:
        temperature = default_temperature if self.temperature is None else self.temperature
        p = generate_pb2.SamplingParams(temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                                        presence_penalty=self.presence_penalty,
                                        frequency_penalty=self.frequency_penalty, max_tokens=max_tokens,
                                        stop_token_ids=stop_token_ids, logprobs=self.logprobs,
                                        top_logprobs=self.top_logprobs)
        if self.seed is not None:
            p.seed = self.seed
        if grammar is not None:
            p.grammar = grammar
        return p


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ChatRun:
    def __init__(self, gen: Generation, fmt: ToolFormat | None, conversation: Conversation, id_prefix: str) -> None:
        self.gen = gen
        self.conversation = conversation
        self._tools = ToolStream(fmt, conversation.tools, id_prefix) if fmt is not None else None
        self.calls: list[ToolCall] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "tool_calls" once done

    @classmethod
    async def count_tokens(cls, gw: Gateway, conv: Conversation, *, param: str) -> int:
        """Prompt tokens of the conversation as the model would see it."""
        return len(await _prompt_ids(gw, conv, param))

    @classmethod
    async def start(cls, gw: Gateway, conv: Conversation, opts: Options, request_id: str, *, param: str,
                    call_id_prefix: str = "call_") -> ChatRun:
        model = gw.model
        tok = model.tokenizer
        fmt = model.tool_format
        prompt_ids = await _prompt_ids(gw, conv, param)
        max_tokens = gw.completion_budget(len(prompt_ids), opts.max_tokens, param)
        grammar = await asyncio.to_thread(_grammar, gw, conv, fmt, max_tokens)
        parse = fmt if conv.parses_tools else None
        gen = Generation(router=gw.router_or_fail(), tokenizer=tok, metrics=gw.metrics, request_id=request_id,
                         prompt_ids=prompt_ids, sampling=opts.sampling(max_tokens, tok.eos_token_ids, grammar,
                                                                gw.settings.gateway.default_temperature),
                         stops=opts.stops, timeout_s=gw.settings.gateway.request_timeout_s,
                         skip_special_tokens=parse is None)
        return cls(gen, parse, conv, call_id_prefix)

    async def pieces(self) -> AsyncGenerator[tuple[Piece, list[Event]], None]:
        """Each piece of the generation with the events it completes; the last has a finish_reason.
        Closing it cancels the generation."""
        pieces = self.gen.pieces()
        try:
            async for piece in pieces:
                events = self._events(piece.text, final=piece.finish_reason is not None)
                if piece.finish_reason is not None:
                    self.finish_reason = "tool_calls" if self.calls else piece.finish_reason
                yield piece, events
        finally:
            await pieces.aclose()

    def _events(self, text: str, final: bool) -> list[Event]:
        if self._tools is None:
            events: list[Event] = [TextDelta(text)] if text else []
        else:
            events = self._tools.feed(text) + (self._tools.close() if final else [])
        out: list[Event] = []
        for e in events:
            if isinstance(e, CallDelta):
                if self.calls and not self.conversation.parallel_tool_calls:
                    continue  # one call was asked for: later ones are dropped
                self.calls.append(e.call)
                e = CallDelta(len(self.calls) - 1, e.call)
            else:
                self.text += e.text
            out.append(e)
        return out

    def usage(self) -> Usage:
        g = self.gen
        return Usage(g.prompt_tokens, g.completion_tokens, g.cached_tokens)


async def _prompt_ids(gw: Gateway, conv: Conversation, param: str) -> list[int]:
    """The conversation through the model's chat template (tools included), tokenized."""
    model = gw.model
    tok = model.tokenizer
    if tok.chat_template is None:
        raise APIError(400, "The model has no chat template; use /v1/completions.", param=param,
                       code="no_chat_template")
    if conv.tools and model.tool_format is None:
        raise APIError(400, f"The model `{model.name}`'s chat template does not render tools, so this gateway "
                       "cannot offer them (send the request without tools, or set gateway.tool_parser for a "
                       "template that does).", param="tools", code="tools_unsupported")
    name = conv.tool_choice.name
    if conv.tool_choice.mode == "named" and conv.tool(name or "") is None:
        raise APIError(400, f"tool_choice names the tool `{name}`, which is not among the tools given.",
                       param="tool_choice", code="invalid_value")
    messages, tools = conv.for_template()
    extra = {} if conv.thinking is None else {"enable_thinking": conv.thinking, "thinking": conv.thinking}
    prompt = tok.chat_template.render(messages, tools=tools, **extra)
    ids: list[int] = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=False)
    return ids


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _grammar(gw: Gateway, conv: Conversation, fmt: ToolFormat | None, max_tokens: int) -> str | None:
    """The llguidance grammar of the answer, checked against the tokenizer (None: unconstrained).
    A schema is fitted to the token budget (moetier.text.grammar.fit_schema), so that the
    answer ends complete whatever the model."""
    model = gw.model
    budget = max(1, max_tokens - GRAMMAR_RESERVE)
    if conv.tools and conv.tool_choice.forced and fmt is not None:
        name = conv.tool_choice.name
        tools = [ToolDef(t.name, t.description, fit_schema(t.parameters, budget - len(t.name)))
                 for t in conv.tools if name is None or t.name == name]
        grammar = lark_grammar(fmt.forced_lark(tools, _marker(gw)))
        what = "tool_choice: the arguments schema of " + ", ".join(f"`{t.name}`" for t in tools)
        param = "tools"
    elif conv.response_schema is not None:
        schema = None if conv.response_schema == "json_object" else fit_schema(conv.response_schema, budget)
        grammar = json_schema_grammar(schema)
        what, param = "the response format's JSON schema", "response_format"
    else:
        return None
    try:
        model.grammars.check(grammar)
    except InvalidArgument as e:
        raise APIError(400, f"{what} cannot be enforced by constrained decoding: "
                       f"{str(e).removeprefix('the grammar cannot be enforced: ')}", param=param,
                       code="unsupported_schema") from None
    return grammar


def _marker(gw: Gateway) -> Any:
    """How a grammar names a format marker: the special token it is in this tokenizer, else text."""
    tok = gw.model.tokenizer.tokenizer
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def marker(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else lark_literal(text)

    return marker


# ---- answering: one body, or one event stream ------------------------------------------------
class RunFormat(Protocol):
    """A wire format's view of a ChatRun: SSE text for a stream, a body otherwise."""

    def start(self, run: ChatRun) -> list[str]: ...

    def events(self, run: ChatRun, piece: Piece, events: list[Event]) -> list[str]: ...

    def end(self, run: ChatRun) -> list[str]: ...

    def error(self, run: ChatRun, err: APIError) -> list[str]: ...

    def body(self, run: ChatRun, tokens: list[Token]) -> Any: ...


async def complete_run(request: Request, run: ChatRun, fmt: RunFormat) -> Any:
    async def collect() -> Any:
        tokens: list[Token] = []
        pieces = run.pieces()
        try:
            async for piece, _ in pieces:
                tokens.extend(piece.tokens)
        finally:
            await pieces.aclose()
        return fmt.body(run, tokens)

    return await cancel_on_disconnect(request, collect())


async def stream_run(request: Request, run: ChatRun, fmt: RunFormat) -> EventStream:
    """Wait for the first piece before answering, so that a refusal up front (429, 503) is
    still an HTTP status; after that, failures become the format's error event."""
    pieces = run.pieces()
    try:
        first = await cancel_on_disconnect(request, anext(pieces))
    except BaseException:
        await pieces.aclose()
        raise

    async def sse() -> AsyncGenerator[str, None]:
        try:
            for e in fmt.start(run):
                yield e
            piece, events = first
            while True:
                for e in fmt.events(run, piece, events):
                    yield e
                if piece.finish_reason:
                    break
                piece, events = await anext(pieces)
            for e in fmt.end(run):
                yield e
        except MoetierError as e:
            for x in fmt.error(run, from_moetier(e)):
                yield x
        except Exception:
            log.exception("stream %s failed", run.gen.request.request_id)
            for x in fmt.error(run, APIError(500, "internal error (see the gateway log)", type="server_error",
                                             code="internal_error")):
                yield x
        finally:
            await pieces.aclose()

    return EventStream(sse())
