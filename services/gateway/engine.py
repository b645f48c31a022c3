"""One request's generation as text: the router's token stream -> detokenized, stop-string
checked pieces, with the gateway's latency and token metrics.

Stop token ids (the model's eos ids) end the generation in the worker; they count as
generated tokens but are never text. A stop string ends it here: the text before it is
the last text, and closing the router stream cancels the rest of the generation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from moetier.errors import Unavailable
from moetier.rpc.v1 import generate_pb2
from moetier.text import IncrementalDetokenizer, StopMatcher, TextTokenizer
from services.gateway.metrics import GatewayMetrics
from services.gateway.router_client import RouterClient, Step, Token


@dataclass(frozen=True)
class Piece:
    text: str  # new text (may be empty while bytes or a partial stop match are held back)
    tokens: tuple[Token, ...]  # the generated tokens this piece accounts for (logprobs)
    finish_reason: str | None  # "stop" | "length" on the last piece


class Generation:
    def __init__(self, *, router: RouterClient, tokenizer: TextTokenizer, metrics: GatewayMetrics,
                 request_id: str, prompt_ids: list[int], sampling: generate_pb2.SamplingParams,
                 stops: list[str], timeout_s: float, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens=False keeps special tokens in the text (tool-call markers that are
        special tokens of their tokenizer); stop ids never become text either way."""
        self.router = router
        self.metrics = metrics
        self.request = generate_pb2.GenerateRequest(request_id=request_id, prompt_ids=prompt_ids,
                                                    sampling=sampling)
        self.timeout_s = timeout_s
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the worker served from its prefix cache
        self._stop_ids = frozenset(sampling.stop_token_ids)
        self._detok = IncrementalDetokenizer(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        self._stops = StopMatcher(stops)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The text of the generation; the last piece has a finish_reason. Raises a
        MoetierError when the router refuses or fails. Closing it cancels the generation."""
        m = self.metrics
        start = last = time.perf_counter()
        first_step, got_token = True, False
        outcome = "abort"  # unless it finishes or fails: the consumer went away
        m.running_requests.inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        steps = self.router.generate(self.request, self.timeout_s)
        try:
            async for step in steps:
                now = time.perf_counter()
                if first_step:
                    m.queue_time.observe(step.queue_s)
                    self.cached_tokens = step.cached_tokens
                piece = self._text(step)
                if n := len(piece.tokens):
                    m.generation_tokens.inc(n)
                    if not got_token:
                        m.time_to_first_token.observe(now - start)
                        got_token = True
                    else:
                        for _ in range(n):
                            m.inter_token_latency.observe((now - last) / n)
                    last = now
                first_step = False
                if piece.finish_reason:
                    outcome = piece.finish_reason
                yield piece
                if piece.finish_reason:
                    return
            raise Unavailable("router: the generation stream ended without a finish reason")
        except Exception:
            outcome = "error"
            raise
        finally:
            await steps.aclose()  # cancels the router call if it is still running
            m.running_requests.dec()
            m.e2e_request_latency.observe(time.perf_counter() - start)
            m.finished_requests.labels(outcome).inc()

    def _text(self, step: Step) -> Piece:
        texts: list[str] = []
        used: list[Token] = []
        for t in step.tokens:
            if self._stops.stopped:
                break
            used.append(t)
            if t.token_id not in self._stop_ids:
                texts.append(self._stops.feed(self._detok.add([t.token_id])))
        self.completion_tokens += len(used)
        finish = None
        if self._stops.stopped:
            finish = "stop"
        elif step.finish_reason is not None:
            texts.append(self._stops.feed(self._detok.flush()))
            texts.append(self._stops.flush())
            finish = "length" if step.finish_reason == "length" and not self._stops.stopped else "stop"
        return Piece("".join(texts), tuple(used), finish)
