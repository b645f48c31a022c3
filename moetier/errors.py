"""One error hierarchy for moetier. Mapped once to gRPC status codes (moetier.rpc.errors)
and once to HTTP + the OpenAI envelope (the gateway). Messages are for users: they name
what is wrong (the file, tensor, layer, expert, offset, field) and never carry a traceback."""

from __future__ import annotations


class MoetierError(Exception):
    """Base class of every error moetier raises on purpose."""


class InvalidArgument(MoetierError):
    """A request, flag or config value is wrong (gRPC INVALID_ARGUMENT, HTTP 400)."""


class NotFound(MoetierError):
    """A named thing does not exist (gRPC NOT_FOUND, HTTP 404)."""


class ResourceExhausted(MoetierError):
    """Queues or budgets are full; retry later (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(MoetierError):
    """A dependency is down or timed out (gRPC UNAVAILABLE / DEADLINE_EXCEEDED, HTTP 503)."""


class RowsUnavailable(Unavailable):
    """Some rows of a layer call cannot be computed (their experts have no live owner among the
    expert stores); the other rows could be. `rows`: their indexes in the call's rows, so the
    caller fails only the requests those rows belong to."""

    def __init__(self, message: str, rows: frozenset[int]) -> None:
        super().__init__(message)
        self.rows = rows


class DataCorruption(MoetierError):
    """Stored bytes failed their checksum and no valid copy exists (gRPC DATA_LOSS)."""


class FormatError(MoetierError):
    """A container, checkpoint or cache file is malformed, incomplete or of the wrong kind."""


class ConversionError(MoetierError):
    """A checkpoint cannot be converted (bad input: unknown architecture, pickle, wrong shape...)."""
