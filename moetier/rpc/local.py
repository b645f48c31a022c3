"""The local lane: ComputeExperts and Prefetch between two processes of one host, without gRPC.

A gRPC round trip costs about a millisecond of Python and C-core work on a busy two-core machine
(an echo service: 1.0-1.2 ms median), a one-packet exchange over a unix socket about a tenth of
that; a decode step makes one ComputeExperts per MoE layer. So an expert store also listens on a
Linux abstract unix socket (SOCK_SEQPACKET: one packet per message, in order, its name in
InfoResponse.local_socket), and a caller on the same host (the same network namespace) that can
reach it sends its calls there. The messages are the proto's (expert_store.proto documents the
frames: a kind byte, then one serialized message); tensors are not copied into them but written
to a shared memory region (a memfd the caller creates and passes with its LocalHello) and named
by offset (Tensor.shared). Callers on another host, or that cannot connect, use gRPC, which
answers the same: the lane changes the speed of a call, never its result.

    server = LocalServer(handle_compute, handle_prefetch, token)     # the store
    server.start(); ... ; server.close()
    lane = LocalClient.connect(name, token, region_bytes)           # the caller
    reply, output = lane.compute(layer, x, ids, weights, step, timeout_s)
    lane.prefetch(prefetch_request)
    lane.close()

A store whose RAM tier holds every expert shares them (LocalReady.shared: a memfd of the records,
mapped read-only here as `SharedView`); its caller then computes those calls itself with the
same kernels and reports them (LocalUsage), so the store still counts them.

The server runs one thread per connection, which computes the calls of that connection itself
(no hand-off to another thread or an event loop). It accepts peers of its own user only
(SO_PEERCRED), as a file in a 0700 directory would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument, MoetierError, ResourceExhausted, Unavailable
from moetier.kernels.fast import park_helpers
from moetier.rpc.errors import from_status, status_code
from moetier.rpc.tensors import from_pb, to_shared
from moetier.rpc.v1 import expert_store_pb2 as pb

log = logging.getLogger(__name__)

HELLO, READY, COMPUTE, PREFETCH, REPLY, ERROR, USAGE = range(1, 8)
MAX_FRAME = 1 << 16  # a frame holds small messages only: tensors are in the region
REGION_BYTES = 64 << 20  # default region: a few prefill chunks of a wide model (pages are touched as used)
HELLO_TIMEOUT_S = 5.0

ComputeHandler = Callable[[pb.ComputeExpertsRequest, mmap.mmap], tuple[pb.ComputeExpertsResponse, np.ndarray]]
PrefetchHandler = Callable[[pb.PrefetchRequest], object]
UsageHandler = Callable[[pb.LocalUsage], object]
F32 = npt.NDArray[np.float32]


@dataclass
class SharedOffer:
    """What a store shares with callers that ask (LocalReady.shared): its records' memory."""

    fd: int  # a memfd; the store keeps it open
    size: int
    table: npt.NDArray[np.int64]  # [N, 4] (layer, expert, offset, length)
    model_id: str


class SharedView:
    """A store's shared records, mapped read-only by a caller: `record(layer, expert)` is the
    verified record's bytes (a view: valid while this object lives)."""

    def __init__(self, mapping: mmap.mmap, table: npt.NDArray[np.int64], model_id: str) -> None:
        self.mapping, self.model_id = mapping, model_id
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)
        self.where = {(int(r[0]), int(r[1])): (int(r[2]), int(r[3])) for r in table.tolist()}
        for (layer, expert), (off, n) in self.where.items():
            if off < 0 or n <= 0 or off + n > len(self._bytes):
                raise Unavailable(f"shared experts: layer {layer} expert {expert} at [{off}, {off + n}) lies "
                                  f"outside the {len(self._bytes)}-byte shared memory")

    def record(self, layer: int, expert: int) -> npt.NDArray[np.uint8]:
        off, n = self.where[(layer, expert)]
        return self._bytes[off : off + n]


def lane_name(token: str) -> str:
    """The printable socket name (InfoResponse.local_socket) of a lane with this token."""
    return f"@moetier-expert-store-{token[:16]}"


def _address(name: str) -> str:
    if not name.startswith("@"):
        raise InvalidArgument(f"local lane {name!r}: expected an abstract socket name starting with '@'")
    return "\0" + name[1:]


def _frame(kind: int, msg: object) -> bytes:
    return bytes([kind]) + msg.SerializeToString()  # type: ignore[attr-defined]


def _error(e: BaseException) -> bytes:
    if isinstance(e, MoetierError):
        retry = int(e.retry_after_s * 1000) if isinstance(e, ResourceExhausted) else 0
        err = pb.LocalError(code=status_code(e).value[0], message=str(e), retry_after_ms=retry)
    else:
        err = pb.LocalError(code=grpc.StatusCode.INTERNAL.value[0], message="internal error (see the server log)")
    return _frame(ERROR, err)


def _raise(payload: bytes, what: str) -> None:
    err = pb.LocalError.FromString(payload)
    code = next((c for c in grpc.StatusCode if c.value[0] == err.code), grpc.StatusCode.UNKNOWN)
    raise from_status(code, f"{what}: {err.message}", err.retry_after_ms / 1000.0 if err.retry_after_ms else 1.0)


# ---- the server (the expert store) ----------------------------------------------------------
class LocalServer:
    def __init__(self, compute: ComputeHandler, prefetch: PrefetchHandler, token: str | None = None, *,
                 shared: Callable[[], SharedOffer | None] | None = None, usage: UsageHandler | None = None) -> None:
        """shared: what the store shares now (None: nothing yet); usage: takes the LocalUsage of
        callers that compute from it."""
        self.token = token or secrets.token_hex(16)
        self.name = lane_name(self.token)
        self._compute, self._prefetch = compute, prefetch
        self._shared, self._usage = shared, usage
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(_address(self.name))
        self._sock.listen(16)
        self._closed = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="expert-store-lane", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
            if uid != os.getuid():
                log.warning("local lane: refused a peer of user %d (pid %d)", uid, pid)
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), name="expert-store-lane-conn", daemon=True)
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        region: mmap.mmap | None = None
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            msg, fds, _, _ = socket.recv_fds(conn, MAX_FRAME, 1)
            conn.settimeout(None)
            if not msg or msg[0] != HELLO or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                return
            hello = pb.LocalHello.FromString(msg[1:])
            try:
                if not secrets.compare_digest(hello.token, self.token):
                    conn.send(_error(Unavailable("local lane: wrong token (another store's lane?)")))
                    return
                region = mmap.mmap(fds[0], int(hello.region_bytes))
            finally:
                os.close(fds[0])
            offer = self._shared() if hello.shared_experts and self._shared is not None else None
            if offer is not None and offer.table.nbytes <= len(region):
                records, _ = to_shared(offer.table, region, 0)
                ready = pb.LocalReady(shared=pb.SharedExperts(bytes=offer.size, records=records,
                                                               model_id=offer.model_id))
                socket.send_fds(conn, [_frame(READY, ready)], [offer.fd])
            else:
                conn.send(_frame(READY, pb.LocalReady()))
            while True:
                park_helpers()  # nothing to compute here until the caller's next call
                msg = conn.recv(MAX_FRAME)
                if not msg:
                    return
                if msg[0] == COMPUTE:
                    conn.send(self._answer(pb.ComputeExpertsRequest.FromString(msg[1:]), region))
                elif msg[0] == PREFETCH:
                    try:
                        self._prefetch(pb.PrefetchRequest.FromString(msg[1:]))
                    except Exception as e:  # a hint never fails anything; say why it was dropped
                        log.debug("local lane: prefetch hint dropped: %s", e)
                elif msg[0] == USAGE and self._usage is not None:
                    try:
                        self._usage(pb.LocalUsage.FromString(msg[1:]))
                    except Exception as e:  # counts only: never fails a call
                        log.warning("local lane: usage report dropped: %s", e)
                else:
                    log.warning("local lane: unknown frame kind %d; closing the connection", msg[0])
                    return
        except OSError as e:
            if not self._closed:
                log.debug("local lane connection ended: %s", e)
        except Exception:
            log.exception("local lane connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if region is not None:
                with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
                    region.close()

    def _answer(self, req: pb.ComputeExpertsRequest, region: mmap.mmap) -> bytes:
        try:
            resp, output = self._compute(req, region)
            out_at = _after(req)
            t, _ = to_shared(output, region, out_at)
            resp.output.CopyFrom(t)
            return _frame(REPLY, resp)
        except ValueError as e:  # the output does not fit the region
            return _error(ResourceExhausted(f"local lane: {e}"))
        except Exception as e:
            if not isinstance(e, MoetierError):
                log.exception("ComputeExperts on the local lane failed")
            return _error(e)

    def close(self, grace_s: float | None = None) -> None:
        """Stop accepting; let each connection's call in flight finish and answer (its next
        read ends the connection), for `grace_s` seconds at most (None: as long as they take),
        then cut the connections that are still computing (their callers see the lane closed)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RD)  # an idle connection ends now, a computing one after its answer
        if self._acceptor.is_alive():
            self._acceptor.join(5)
        deadline = None if grace_s is None else time.monotonic() + grace_s
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            late = list(self._conns)
        for c in late:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _after(req: pb.ComputeExpertsRequest) -> int:
    """The first aligned offset past the request's tensors: where the answer goes."""
    end = 0
    for t in (req.hidden, req.expert_ids, req.weights):
        if t.HasField("shared"):
            n = math.prod(t.shape) * np.dtype(t.dtype).itemsize
            end = max(end, t.shared.offset + n)
    return -(-end // 64) * 64


# ---- the client (the dense worker) ------------------------------------------------------------
class LocalClient:
    """One connection to a store's lane. Compute calls are one at a time (a lock); hints may be
    sent from any thread meanwhile (a packet is sent whole)."""

    def __init__(self, sock: socket.socket, region: mmap.mmap, name: str,
                 shared: SharedView | None = None) -> None:
        self.sock, self.region, self.name = sock, region, name
        self.shared = shared  # the store's records, where it shares them (LocalReady.shared)
        self.lock = threading.Lock()
        self.closed = False  # the connection failed or was closed: make a new one
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLPRI)

    @classmethod
    def connect(cls, name: str, token: str, region_bytes: int = REGION_BYTES,
                timeout_s: float = HELLO_TIMEOUT_S, *, shared: bool = False) -> LocalClient:
        """Connect and hand over a fresh region; Unavailable when the lane cannot be reached or
        refuses (the caller then uses gRPC). shared: ask for the store's shared records."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        fd = -1
        fds: list[int] = []
        try:
            sock.settimeout(timeout_s)
            sock.connect(_address(name))
            fd = os.memfd_create("moetier-lane", os.MFD_CLOEXEC)
            os.ftruncate(fd, region_bytes)
            region = mmap.mmap(fd, region_bytes)
            hello = pb.LocalHello(token=token, region_bytes=region_bytes, shared_experts=shared)
            socket.send_fds(sock, [_frame(HELLO, hello)], [fd])
            msg, fds, _, _ = socket.recv_fds(sock, MAX_FRAME, 1)
            if msg[:1] == bytes([ERROR]):
                _raise(msg[1:], f"expert store lane {name}")
            if msg[:1] != bytes([READY]):
                raise Unavailable(f"expert store lane {name}: no answer to the hello")
            ready = pb.LocalReady.FromString(msg[1:])
            records = None
            if ready.HasField("shared") and len(fds) == 1:
                sh = ready.shared
                mapping = mmap.mmap(fds[0], int(sh.bytes), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                try:
                    table = from_pb(sh.records, "shared experts", "int64", 2, region=region).copy()
                except InvalidArgument as e:
                    raise Unavailable(f"expert store lane {name}: malformed shared experts: {e}") from None
                if table.shape[1] != 4:
                    raise Unavailable(f"expert store lane {name}: shared experts table {list(table.shape)}, "
                                      "expected [N, 4]")
                records = SharedView(mapping, table, sh.model_id)
        except OSError as e:
            sock.close()
            raise Unavailable(f"expert store lane {name}: {e.strerror or e}") from None
        except BaseException:
            sock.close()
            raise
        finally:
            for f in [fd, *fds]:
                if f >= 0:
                    os.close(f)
        return cls(sock, region, name, records)

    def alive(self) -> bool:
        """The store has not closed the lane (checked without waiting: between calls it never
        sends, so anything to read is its end). False closes the lane here too."""
        if self.closed:
            return False
        try:
            if not self._poll.poll(0):
                return True
        except OSError:
            pass
        self.close()
        return False

    def usage(self, msg: pb.LocalUsage) -> None:
        """Report calls computed from the shared records (no answer)."""
        try:
            self.sock.send(_frame(USAGE, msg))
        except OSError as e:
            self.close()
            raise Unavailable(f"expert store lane {self.name}: {e.strerror or e}") from None

    def compute(self, req: pb.ComputeExpertsRequest, x: F32, ids: npt.NDArray[np.int32], weights: F32,
                timeout_s: float) -> tuple[pb.ComputeExpertsResponse, F32]:
        """Send the call (its tensors into the region) and wait for the answer: the response and
        its output [T, D] (a copy: the region is reused by the next call). ValueError when the
        tensors do not fit the region (the caller uses gRPC for this one); Unavailable when
        the lane fails or the deadline passes (the lane is then closed)."""
        with self.lock:
            self.send_compute(req, x, ids, weights)
            return self.receive(req, timeout_s)

    def send_compute(self, req: pb.ComputeExpertsRequest, x: F32, ids: npt.NDArray[np.int32], weights: F32) -> None:
        """The first half of `compute`, for a caller that works meanwhile; hold `lock` until
        `receive` returns."""
        off = 0
        for name, a in (("hidden", x), ("expert_ids", ids), ("weights", weights)):
            t, off = to_shared(a, self.region, off)
            getattr(req, name).CopyFrom(t)
        if off + x.nbytes > len(self.region):
            raise ValueError(f"{off + x.nbytes} bytes of tensors do not fit the {len(self.region)}-byte region")
        try:
            self.sock.send(_frame(COMPUTE, req))
        except OSError as e:
            self.close()
            raise Unavailable(f"expert store lane {self.name}: {e.strerror or e}") from None

    def receive(self, req: pb.ComputeExpertsRequest, timeout_s: float) -> tuple[pb.ComputeExpertsResponse, F32]:
        what = f"expert store lane {self.name}: ComputeExperts of layer {req.layer}"
        park_helpers()  # nothing to compute here until the store answers
        try:
            self.sock.settimeout(timeout_s)
            msg = self.sock.recv(MAX_FRAME)
        except OSError as e:  # socket.timeout included
            self.close()
            raise Unavailable(f"{what}: {'deadline exceeded' if isinstance(e, TimeoutError) else e}") from None
        if not msg:
            self.close()
            raise Unavailable(f"{what}: the store closed the lane")
        if msg[0] == ERROR:
            _raise(msg[1:], what)
        if msg[0] != REPLY:
            self.close()
            raise Unavailable(f"{what}: unexpected frame kind {msg[0]}")
        resp = pb.ComputeExpertsResponse.FromString(msg[1:])
        try:
            out = from_pb(resp.output, "ComputeExperts output", "float32", 2, region=self.region).copy()
        except InvalidArgument as e:
            raise Unavailable(f"{what}: malformed answer: {e}") from None
        return resp, out

    def prefetch(self, req: pb.PrefetchRequest) -> None:
        try:
            self.sock.send(_frame(PREFETCH, req))
        except OSError as e:
            self.close()
            raise Unavailable(f"expert store lane {self.name}: {e.strerror or e}") from None

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
