"""Response bodies and stream chunks in OpenAI's exact shapes, one class per endpoint.

Chat stream: a first chunk with {"role": "assistant", "content": ""}, content chunks, a
chunk with an empty delta and the finish_reason, with include_usage a last chunk with
empty choices and the usage (and "usage": null on every other chunk), then [DONE].
Completion stream: text chunks, the last one with the finish_reason, the usage chunk.
"""

from __future__ import annotations

from typing import Any

from moetier.text import TextTokenizer
from services.gateway.engine import Piece
from services.gateway.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from services.gateway.router_client import Token

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


class ChatFormat(_Format):
    object_name = "chat.completion.chunk"

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        out = []
        lps = self._logprobs(piece.tokens)
        if piece.text or lps is not None:
            out.append(self._chunk({"index": 0, "delta": {"content": piece.text},
                                    "logprobs": lps.model_dump() if lps else None, "finish_reason": None}))
        if piece.finish_reason:
            out.append(self._chunk({"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": piece.finish_reason}))
        return out

    def body(self, text: str, tokens: list[Token], finish_reason: str | None, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=text),
                            logprobs=self._logprobs(tokens), finish_reason=finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

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
        lps = self._logprobs(piece.tokens)
        if not (piece.text or lps or piece.finish_reason):
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
