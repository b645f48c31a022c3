"""The HTTP routes. Handlers are thin: check the model, build the prompt ids, size the
completion against the context, then answer from one `Generation` as a body or a stream."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from moetier.errors import MoetierError, Unavailable
from moetier.settings import Settings
from services.gateway.chat import ChatRun, Options, complete_run, new_id, stream_run
from services.gateway.engine import Generation
from services.gateway.errors import APIError, envelope, from_moetier
from services.gateway.formats import ChatFormat, CompletionFormat
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    now,
)
from services.gateway.router_client import RouterClient, Token
from services.gateway.sse import DONE, EventStream, cancel_on_disconnect, event

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Everything a request needs; one per app, on app.state.gateway."""

    settings: Settings
    model: ServedModel
    metrics: GatewayMetrics
    router: RouterClient | None = None  # opened by the app's lifespan

    @property
    def context_limit(self) -> int:
        return self.model.context_limit(self.settings.inference.max_seq_len)

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise APIError(404, f"The model `{name}` does not exist; this gateway serves `{self.model.name}`.",
                           param="model", code="model_not_found")

    def completion_budget(self, prompt_tokens: int, requested: int | None, param: str) -> int:
        """max_tokens for the worker: what was asked, else gateway.default_max_tokens, else the rest
        of the context."""
        limit = self.context_limit
        mpe = self.model.max_position_embeddings
        why = f"inference.max_seq_len={self.settings.inference.max_seq_len}" + (
            f", the model's max_position_embeddings={mpe}" if mpe is not None else "")
        if prompt_tokens == 0:
            raise APIError(400, "The prompt is empty.", param=param, code="invalid_value")
        if requested is None:
            if prompt_tokens >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens ({why}); the prompt "
                               f"is {prompt_tokens} tokens, which leaves no room for a completion.",
                               param=param, code="context_length_exceeded")
            return min(limit - prompt_tokens, self.settings.gateway.default_max_tokens or limit)
        if prompt_tokens + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens ({why}). However, you "
                           f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
                           f"{requested} for the completion). Shorten the prompt or lower max_tokens.",
                           param=param, code="context_length_exceeded")
        return requested

    def router_or_fail(self) -> RouterClient:
        if self.router is None:
            raise Unavailable("the gateway is not started (no router connection)")
        return self.router

    def generation(self, request_id: str, prompt_ids: list[int], body: CompletionRequest,
                   max_tokens: int) -> Generation:
        tok = self.model.tokenizer
        return Generation(router=self.router_or_fail(), tokenizer=tok, metrics=self.metrics, request_id=request_id,
                          prompt_ids=prompt_ids,
                          sampling=body.to_sampling_params(max_tokens=max_tokens, stop_token_ids=tok.eos_token_ids,
                                                           default_temperature=self.settings.gateway.default_temperature),
                          stops=body.stops, timeout_s=self.settings.gateway.request_timeout_s)


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(_gateway)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in [
        (400, "Invalid request, or the prompt does not fit the context"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "The cluster's queues are full; retry after Retry-After seconds"),
        (503, "No dense worker serves, or the router is unreachable"),
    ]
}
_STREAM: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                 "description": "The body, or with stream=true server-sent events ending with `data: [DONE]`"}}

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={**_ERRORS, **_STREAM})
async def chat_completions(body: ChatCompletionRequest, request: Request, gw: GatewayDep) -> Any:
    gw.check_model(body.model)
    request_id = new_id("chatcmpl-")
    opts = Options(max_tokens=body.requested_max_tokens,
                   temperature=body.temperature,
                   top_p=body.top_p if body.top_p is not None else 1.0, top_k=body.top_k or 0, seed=body.seed,
                   presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                   stops=body.stops, logprobs=bool(body.logprobs),
                   top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0)
    run = await ChatRun.start(gw, body.to_conversation(), opts, request_id, param="messages")
    fmt = ChatFormat(id=request_id, created=now(), model=gw.model.name, tokenizer=gw.model.tokenizer,
                     logprobs=bool(body.logprobs),
                     include_usage=bool(body.stream_options and body.stream_options.include_usage))
    if body.stream:
        return await stream_run(request, run, fmt)
    return await complete_run(request, run, fmt)


@router.post("/v1/completions", response_model=Completion, responses={**_ERRORS, **_STREAM})
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep) -> Any:
    gw.check_model(body.model)
    tok = gw.model.tokenizer
    prompt = body.single_prompt
    if isinstance(prompt, str):
        prompt_ids = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=True)
    else:
        prompt_ids = list(prompt)
        if bad := [i for i in prompt_ids if i >= tok.vocab_size]:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary ({tok.vocab_size} tokens)",
                           param="prompt", code="invalid_value")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
    max_tokens = gw.completion_budget(len(prompt_ids), body.max_tokens, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = gw.generation(request_id, prompt_ids, body, max_tokens)
    echo = (prompt if isinstance(prompt, str) else tok.decode(prompt_ids)) if body.echo else ""
    fmt = CompletionFormat(id=request_id, created=now(), model=gw.model.name, tokenizer=tok,
                           logprobs=body.logprobs is not None, echo=echo,
                           include_usage=bool(body.stream_options and body.stream_options.include_usage))
    if body.stream:
        return await _stream(request, gen, fmt)
    return await _complete(request, gen, fmt)


def _usage(gen: Generation) -> Usage:
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                 total_tokens=gen.prompt_tokens + gen.completion_tokens)


async def _complete(request: Request, gen: Generation, fmt: CompletionFormat) -> Any:
    async def run() -> Any:
        texts: list[str] = []
        tokens: list[Token] = []
        finish = None
        pieces = gen.pieces()
        try:
            async for p in pieces:
                texts.append(p.text)
                tokens.extend(p.tokens)
                finish = p.finish_reason
        finally:
            await pieces.aclose()
        return fmt.body("".join(texts), tokens, finish, _usage(gen))

    return await cancel_on_disconnect(request, run())


async def _stream(request: Request, gen: Generation, fmt: CompletionFormat) -> EventStream:
    """Wait for the first piece before answering, so that a refusal up front (429, 503)
    is still an HTTP status; after that, failures become an error event."""
    pieces = gen.pieces()
    try:
        first = await cancel_on_disconnect(request, anext(pieces))
    except BaseException:
        await pieces.aclose()
        raise

    async def events() -> Any:
        try:
            for c in fmt.start():
                yield event(c)
            piece = first
            while True:
                for c in fmt.chunks(piece):
                    yield event(c)
                if piece.finish_reason:
                    break
                piece = await anext(pieces)
            if fmt.include_usage:
                yield event(fmt.usage_chunk(_usage(gen)))
        except MoetierError as e:
            err = from_moetier(e)
            yield event(envelope(err.message, err.type, err.param, err.code))
        except Exception:
            log.exception("stream %s failed", fmt.id)
            yield event(envelope("internal error (see the gateway log)", "server_error", None, "internal_error"))
        finally:
            await pieces.aclose()
        yield DONE

    return EventStream(events())


@router.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
async def models(gw: GatewayDep) -> ModelList:
    return ModelList(data=[ModelCard(id=gw.model.name, created=gw.model.created, max_model_len=gw.context_limit)])


@router.get("/health", responses={503: {"description": "No dense worker or no expert store serves"}})
async def health(gw: GatewayDep) -> JSONResponse:
    """200 while the router reports at least one dense worker and one expert store."""
    if gw.router is None:
        return JSONResponse({"status": "unavailable", "reason": "not started"}, status_code=503)
    try:
        c = await gw.router.cluster_status()
    except Unavailable as e:
        return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
    body: dict[str, Any] = {"status": "ok" if c.serving else "unavailable", "dense_workers": c.dense_workers,
                            "expert_stores": c.expert_stores, "queued": c.queued, "queue_capacity": c.queue_capacity}
    if not c.serving:
        missing = [k for k, v in (("dense worker", c.dense_workers), ("expert store", c.expert_stores)) if not v]
        body["reason"] = "no " + " and no ".join(missing) + " registered with the router"
    return JSONResponse(body, status_code=200 if c.serving else 503)


@router.get("/metrics", response_class=Response)
async def metrics(gw: GatewayDep) -> Response:
    return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
