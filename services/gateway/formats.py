"""Response bodies and stream chunks in OpenAI's exact shapes, one class per endpoint.

Chat stream: a first chunk with {"role": "assistant", "content": ""}, content chunks and
tool call chunks (each call whole in one delta: {"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]}), a chunk with an empty delta and the finish_reason
("tool_calls" when the answer made calls), with include_usage a last chunk with empty
choices and the usage (and "usage": null on every other chunk), then [DONE].
Completion stream: text chunks, the last one with the finish_reason, the usage chunk.
"""

from __future__ import annotations

from typing import Any

from moetier.text import TextTokenizer
from moetier.text.conversation import CallDelta, Event
from services.gateway.chat import ChatRun
from services.gateway.engine import Piece
from services.gateway.errors import APIError, envelope
from services.gateway.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatResponseMessage,
    ChatToolCall,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from services.gateway.router_client import Token
from services.gateway.sse import DONE, event

UNREPORTED = -9999.0  # a logprob the worker did not report (OpenAI's "very unlikely")


class _Format:
    object_name = ""

    def __init__(self, *, id: str, created: int, model: str, tokenizer: TextTokenizer, logprobs: bool,
                 include_usage: bool) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.tok = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": self.id, "object": self.object_name, "created": self.created,
                             "model": self.model, "choices": [choice]}
        if self.include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [], "usage": usage.model_dump()}

    def _top(self, t: Token) -> list[TopLogprob]:
        return [TopLogprob(token=self.tok.token_text(i), logprob=lp, bytes=list(self.tok.token_bytes(i)))
                for i, lp in t.top_logprobs]


def chat_usage(run: ChatRun) -> Usage:
    u = run.usage()
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))


class ChatFormat(_Format):
    """/v1/chat/completions over a ChatRun (services.gateway.chat.RunFormat)."""

    object_name = "chat.completion.chunk"

    def start(self, run: ChatRun) -> list[str]:
        return [event(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}))]

    def events(self, run: ChatRun, piece: Piece, events: list[Event]) -> list[str]:
        out = []
        lps = self._logprobs(piece.tokens)
        text = "".join(getattr(e, "text", "") for e in events)
        if text or lps is not None:
            out.append(self._chunk({"index": 0, "delta": {"content": text},
                                    "logprobs": lps.model_dump() if lps else None, "finish_reason": None}))
        for e in events:
            if isinstance(e, CallDelta):
                call = {"index": e.index, "id": e.call.id, "type": "function",
                        "function": {"name": e.call.name, "arguments": e.call.arguments}}
                out.append(self._chunk({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None,
                                        "finish_reason": None}))
        if piece.finish_reason:
            out.append(self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": run.finish_reason}))
        return [event(c) for c in out]

    def end(self, run: ChatRun) -> list[str]:
        return ([event(self.usage_chunk(chat_usage(run)))] if self.include_usage else []) + [DONE]

    def error(self, run: ChatRun, err: APIError) -> list[str]:
        return [event(envelope(err.message, err.type, err.param, err.code)), DONE]

    def body(self, run: ChatRun, tokens: list[Token]) -> ChatCompletion:
        calls = [ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in run.calls]
        message = ChatResponseMessage(content=run.text if run.text or not calls else None, tool_calls=calls or None)
        choice = ChatChoice(index=0, message=message, logprobs=self._logprobs(tokens),
                            finish_reason=run.finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=chat_usage(run))

    def _logprobs(self, tokens: tuple[Token, ...] | list[Token]) -> ChatLogprobs | None:
        if not self.logprobs or not tokens:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(token=self.tok.token_text(t.token_id),
                         logprob=t.logprob if t.logprob is not None else UNREPORTED,
                         bytes=list(self.tok.token_bytes(t.token_id)), top_logprobs=self._top(t))
            for t in tokens
        ])


class CompletionFormat(_Format):
    object_name = "text_completion"

    def __init__(self, *, echo: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.echo = echo
        self._offset = len(echo)  # text_offset of the next token

    def start(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [self._chunk({"index": 0, "text": self.echo, "logprobs": None, "finish_reason": None})]

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        # a chunk for every piece that carries tokens, even one whose text is still held back
        # (bytes of a multi-byte character, a partial stop match): one chunk per generated
        # step, as llama.cpp's server streams, so a client can time each step
        lps = self._logprobs(piece.tokens)
        if not (piece.text or piece.tokens or lps or piece.finish_reason):
            return []
        return [self._chunk({"index": 0, "text": piece.text, "logprobs": lps.model_dump() if lps else None,
                             "finish_reason": piece.finish_reason})]

    def body(self, text: str, tokens: list[Token], finish_reason: str | None, usage: Usage) -> Completion:
        choice = CompletionChoice(index=0, text=self.echo + text, logprobs=self._logprobs(tokens),
                                  finish_reason=finish_reason)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def _logprobs(self, tokens: tuple[Token, ...] | list[Token]) -> CompletionLogprobs | None:
        if not self.logprobs or not tokens:
            return None
        texts = [self.tok.token_text(t.token_id) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(self._offset)
            self._offset += len(s)
        return CompletionLogprobs(
            tokens=texts,
            token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{p.token: p.logprob for p in self._top(t)} for t in tokens],
            text_offset=offsets,
        )
