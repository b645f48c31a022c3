"""Pure ASGI middlewares: they answer before FastAPI reads or parses anything.

Order, outermost first: HTTP status metrics -> API key (401) -> body limit (413) -> app.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError, error_response
from services.gateway.metrics import GatewayMetrics


class StatusMetrics:
    """Counts every HTTP response by endpoint and status code: 500 when the app raised,
    499 when it answered nothing because the client went away first."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500
            raise
        finally:
            self.metrics.count_http(scope["path"], status or 499)


PROTECTED = ("/v1/", "/dashboard/")  # generate or reveal the model; /health, /metrics and the page stay open


class APIKeyAuth:
    """With an API key set, /v1/* and the dashboard's data (/dashboard/*) need `Authorization: Bearer
    <key>` or `x-api-key: <key>` (compared in constant time). Errors take the envelope of the API the
    path belongs to. docs/security.md says which routes are open and why."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith(PROTECTED):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            given = headers.get(b"x-api-key", b"")  # Anthropic's header
        if not given.strip():
            problem = "You didn't provide an API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`."
        elif not hmac.compare_digest(given.strip(), self.key):
            problem = "Incorrect API key provided."
        else:
            await self.app(scope, receive, send)
            return
        response = error_response(APIError(401, problem, type="authentication_error", code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"}), scope["path"])
        await response(scope, receive, send)


class BodyLimit:
    """Refuses bodies over max_bytes with 413: at once when Content-Length says so, else
    while counting the streamed chunks. At most max_bytes are ever held in memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(APIError(
            413, f"Request body too large: the limit is {self.max_bytes} bytes (gateway.max_body_bytes).",
            code="request_too_large"), scope["path"])
        await response(scope, receive, send)
