"""The gateway's side of the router's gRPC API. Protobuf stops here: callers get plain
dataclasses and moetier errors (moetier.rpc.errors.from_rpc_error: RESOURCE_EXHAUSTED ->
ResourceExhausted with its retry hint, UNAVAILABLE / DEADLINE_EXCEEDED -> Unavailable)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc

from moetier.errors import Unavailable
from moetier.rpc.channels import RECONNECT_OPTIONS
from moetier.rpc.errors import from_rpc_error
from moetier.rpc.v1 import generate_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class Step:
    """One message of the Generate stream."""

    tokens: tuple[Token, ...]
    finish_reason: str | None = None  # "stop" | "length" on the last message
    prompt_tokens: int = 0  # first message only
    cached_tokens: int = 0  # first message only: prompt tokens served from the worker's prefix cache
    queue_s: float = 0.0  # first message only
    worker_id: str = ""  # first message only

    @classmethod
    def from_pb(cls, m: generate_pb2.GenerateResponse) -> Step:
        return cls(
            tokens=tuple(
                Token(t.token_id, t.logprob if t.HasField("logprob") else None,
                      tuple((a.token_id, a.logprob) for a in t.top_logprobs))
                for t in m.tokens
            ),
            finish_reason=m.finish_reason if m.HasField("finish_reason") else None,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            queue_s=m.queue_ns / 1e9,
            worker_id=m.worker_id,
        )


@dataclass(frozen=True)
class Cluster:
    """Who is up, from the router's ClusterStatus."""

    dense_workers: list[str] = field(default_factory=list)
    expert_stores: list[str] = field(default_factory=list)
    queued: int = 0
    queue_capacity: int = 0

    @property
    def serving(self) -> bool:
        return bool(self.dense_workers) and bool(self.expert_stores)


class RouterClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def cluster_status(self, timeout_s: float = 2.0) -> Cluster:
        try:
            r = await self._stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"router at {self.address}: {e.details() or e.code().name}") from None
        kinds: dict[int, list[str]] = {router_pb2.MEMBER_KIND_DENSE_WORKER: [], router_pb2.MEMBER_KIND_EXPERT_STORE: []}
        for m in r.members:
            kinds.get(m.kind, []).append(m.member_id)
        return Cluster(kinds[router_pb2.MEMBER_KIND_DENSE_WORKER], kinds[router_pb2.MEMBER_KIND_EXPERT_STORE],
                       r.queued, r.queue_capacity)

    async def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float) -> AsyncGenerator[Step, None]:
        """The token stream of one request. Closing the iterator (or cancelling the task
        that drives it) cancels the RPC, which cancels the generation down the chain."""
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for m in call:
                yield Step.from_pb(m)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "router") from None
        finally:
            if not call.done():
                call.cancel()
                log.debug("request %s: router call cancelled", request.request_id)
