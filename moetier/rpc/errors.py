"""The one mapping between moetier errors and gRPC status codes, both directions.

Servicers wrap their bodies in `rpc_errors(context)`: a MoetierError becomes its
status code with the message; anything else becomes INTERNAL with a generic
message (the traceback is logged, never sent). Clients turn an AioRpcError back
into the matching MoetierError with `from_rpc_error`; `answered` tells an error the server
raised itself from one of reaching it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from moetier.errors import (
    DataCorruption,
    InvalidArgument,
    MoetierError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
# Trailing metadata of every error a moetier servicer raised itself (the error class's name): the
# service is up and answered, so an UNAVAILABLE carrying it means "a dependency of the request is
# down" (say its expert store), not "the service is gone" (a connection refused or reset has none).
ANSWERED_KEY = "moetier-error"


def answered(e: grpc.RpcError) -> bool:
    """The server itself failed the call (`rpc_errors`), as opposed to the call not reaching it."""
    meta = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return any(k == ANSWERED_KEY for k, _ in (meta or ()))

_TO_CODE: list[tuple[type[MoetierError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DataCorruption, grpc.StatusCode.DATA_LOSS),
]


def status_code(err: MoetierError) -> grpc.StatusCode:
    for cls, code in _TO_CODE:
        if isinstance(err, cls):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


@asynccontextmanager
async def rpc_errors(context: grpc.aio.ServicerContext, what: str) -> AsyncIterator[None]:
    """Map exceptions raised inside a servicer method to a gRPC status."""
    try:
        yield
    except MoetierError as e:
        meta: tuple[tuple[str, str], ...] = ((ANSWERED_KEY, type(e).__name__),)
        if isinstance(e, ResourceExhausted):
            meta += ((RETRY_AFTER_KEY, str(int(e.retry_after_s * 1000))),)
        context.set_trailing_metadata(meta)
        await context.abort(status_code(e), str(e))
    except grpc.aio.AbortError:
        raise
    except Exception:
        log.exception("%s failed", what)
        await context.abort(grpc.StatusCode.INTERNAL, f"{what}: internal error (see the server log)")


def from_rpc_error(e: grpc.RpcError, what: str) -> MoetierError:
    """A client-side gRPC error as the matching MoetierError (message prefixed by `what`)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    retry = 1.0
    for k, v in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if k == RETRY_AFTER_KEY:
            retry = int(v) / 1000.0
    return from_status(code, f"{what}: {details}", retry)


def from_status(code: grpc.StatusCode, msg: str, retry_after_s: float = 1.0) -> MoetierError:
    """The MoetierError a call failing with `code` raises (a gRPC call, or the local lane's LocalError)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(msg, retry_after_s=retry_after_s)
    if code == grpc.StatusCode.DATA_LOSS:
        return DataCorruption(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(msg)
    return MoetierError(msg)
