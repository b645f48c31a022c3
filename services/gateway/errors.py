"""HTTP errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}.

One handler per error type (`install_handlers`): APIError (the gateway's own checks,
already in OpenAI terms), RequestValidationError (400), MoetierError (via
`from_moetier`: InvalidArgument 400, NotFound 404, ResourceExhausted 429 + Retry-After,
Unavailable 503, others 500), starlette's HTTPException (unknown path, wrong method) and
any other exception (500, logged). 401 and 413 come from the middlewares, which answer
before the app runs, through `error_response`. The full table is in docs/gateway.md.
Messages never carry a traceback.

Paths of the Anthropic Messages API (/v1/messages...) answer the same errors in Anthropic's
envelope, {"type": "error", "error": {"type", "message"}}, with its types per status
(`anthropic_error`): 400 invalid_request_error, 401 authentication_error, 404
not_found_error, 413 request_too_large, 429 rate_limit_error, 500 api_error, and 529
overloaded_error where the OpenAI paths answer 503 (no worker serves: Anthropic's clients
retry a 529).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetier.errors import InvalidArgument, MoetierError, NotFound, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the gateway answers with, already in OpenAI terms."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                   500: "api_error", 529: "overloaded_error"}


def anthropic_error(e: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in the Anthropic envelope."""
    status = 529 if e.status == 503 else e.status
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError, path: str = "") -> JSONResponse:
    if path.startswith(ANTHROPIC_PREFIX):
        status, body = anthropic_error(e)
        return JSONResponse(body, status_code=status, headers=e.headers)
    return JSONResponse(envelope(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def from_moetier(e: MoetierError) -> APIError:
    """The one mapping from the moetier error hierarchy to HTTP (streams use it for error chunks)."""
    msg = str(e)
    if isinstance(e, InvalidArgument):
        return APIError(400, msg, code="invalid_value")
    if isinstance(e, NotFound):
        return APIError(404, msg, code="not_found")
    if isinstance(e, ResourceExhausted):
        retry = max(1, math.ceil(e.retry_after_s))
        return APIError(429, msg, type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(retry)})
    if isinstance(e, Unavailable):
        return APIError(503, msg, type="service_unavailable", code="service_unavailable")
    log.error("request failed: %s", msg)
    return APIError(500, msg, type="server_error", code="internal_error")


_UNION_TAGS = ("str", "int", "float", "bool", "dict", "list")


def _loc(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted field path, without "body" and union tags."""
    if loc and loc[0] == "body":
        loc = loc[1:]
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p)))


def validation_error(request: Request, e: RequestValidationError) -> APIError:
    errors = list(e.errors())
    if any(err.get("type") == "json_invalid" for err in errors):
        detail = next(err for err in errors if err.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"We could not parse the JSON body of your request ({detail}).", code="invalid_json")
    ctype = request.headers.get("content-type", "")
    if ctype and "json" not in ctype.lower():
        return APIError(400, f"Content-Type must be application/json (got {ctype!r}).", code="invalid_content_type")
    problems = []
    for err in errors[:4]:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        where = _loc(tuple(err.get("loc", ())))
        problems.append(f"{where}: {msg}" if where else msg)
    first = _loc(tuple(errors[0].get("loc", ()))) if errors else ""
    param = first.split(".")[0] or None
    return APIError(400, "; ".join(problems) or "invalid request", param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(request, e), request.url.path)

    @app.exception_handler(MoetierError)
    async def _moetier(request: Request, e: MoetierError) -> JSONResponse:
        return error_response(from_moetier(e), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), headers=dict(e.headers or {})),
                              request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(APIError(500, "internal error (see the gateway log)", type="server_error",
                                       code="internal_error"), request.url.path)
