"""The router's side of DenseWorker.Generate: one channel per worker, the relay of a stream.

A worker call that fails with UNAVAILABLE or CANCELLED (the connection went away, the
worker stopped, or its channel was closed because it left the cluster) raises
WorkerGone (an Unavailable) at once and drops the worker from the routing table until
it registers again -- unless the worker itself failed the request (`answered`: say with
UNAVAILABLE because experts of the request have no live store, or because it is stopping): it
stays in the table, and the request, if nothing was relayed yet, is tried elsewhere as well. Every other worker error reaches the caller with its own status
(RESOURCE_EXHAUSTED keeps its retry hint).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc

from moetier.errors import Unavailable
from moetier.rpc.channels import RECONNECT_OPTIONS
from moetier.rpc.errors import answered, from_rpc_error
from moetier.rpc.v1 import dense_worker_pb2_grpc, generate_pb2
from services.router.registry import LeaveReason, Member, Registry
from services.router.scheduler import Lease

log = logging.getLogger(__name__)

# Codes by which a worker call says the worker itself is gone (not that the request was bad).
_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class WorkerGone(Unavailable):
    """The worker failed or left the cluster during the call (it has left the routing table)."""


class WorkerClients:
    """Channels to dense workers, reused across requests, closed when their worker leaves."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        registry.add_listener(self._on_member)

    def _stub(self, member: Member) -> dense_worker_pb2_grpc.DenseWorkerStub:
        entry = self._channels.get(member.member_id)
        if entry is None or entry[0] != member.info.address:
            self._drop(member.member_id)
            entry = (member.info.address, grpc.aio.insecure_channel(member.info.address, options=RECONNECT_OPTIONS))
            self._channels[member.member_id] = entry
        return dense_worker_pb2_grpc.DenseWorkerStub(entry[1])

    def _on_member(self, member: Member, left: LeaveReason | None) -> None:
        if left is not None:
            # Closing the channel fails the calls still on it at once, instead of letting a
            # silent (frozen, partitioned) worker hold its callers until their deadlines.
            self._drop(member.member_id)

    def _drop(self, member_id: str) -> None:
        entry = self._channels.pop(member_id, None)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[1].close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for member_id in list(self._channels):
            self._drop(member_id)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def generate(self, lease: Lease, request: generate_pb2.GenerateRequest,
                       timeout_s: float) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """Relay the worker's stream. Closing this generator (the caller went away) cancels
        the worker call, which frees the sequence's KV on the worker."""
        member_id = lease.member.member_id
        call = self._stub(lease.member).Generate(request, timeout=timeout_s)
        first = True
        try:
            async for msg in call:
                if first:
                    first = False
                    msg.worker_id = member_id
                    # queue_ns counts every queue before the first step: the router's and the worker's.
                    msg.queue_ns += int(lease.queued_s * 1e9)
                yield msg
        except grpc.aio.AioRpcError as e:
            if e.code() in _WORKER_GONE:
                log.warning("dense worker %s failed request %s: %s %s", member_id, request.request_id,
                            e.code().name, e.details())
                current = self._registry.get(member_id)
                if current is not None and current.info.address == lease.member.info.address and not answered(e):
                    self._registry.remove(member_id, "failed")  # it did not answer: gone
                raise WorkerGone(f"dense worker {member_id}: {e.details() or e.code().name}") from None
            raise from_rpc_error(e, f"dense worker {member_id}") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller went away
            # The call was cancelled under us: the worker left and its channel was closed.
            raise WorkerGone(f"dense worker {member_id} left the cluster") from None
        finally:
            call.cancel()
