"""Server-sent events and client disconnects.

A client that goes away must cancel its generation down the chain. Starlette does not
cancel a handler when the client disconnects, so both paths watch the ASGI `receive`
channel for `http.disconnect` themselves: `cancel_on_disconnect` for work awaited before
a response starts, `EventStream` while a stream is being sent. Either way the async
generator of the generation is closed at once, which cancels the router call.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import APIError

log = logging.getLogger(__name__)

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work; if the client disconnects first, cancel it and answer 499."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        log.info("%s %s: client disconnected, generation cancelled", request.method, request.url.path)
        raise APIError(499, "client closed the request")
    return task.result()


class EventStream(StreamingResponse):
    """text/event-stream from an async generator of ready-made events; closes the generator
    as soon as the client disconnects (or the stream ends)."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump, watch):
                t.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            await self._events.aclose()
        if not pump.cancelled() and (exc := pump.exception()) is not None and not isinstance(exc, OSError):
            raise exc
