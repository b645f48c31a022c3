"""moetier/rpc/serving.py, what the gRPC services share, here its bind failures: a second router,
expert store, dense worker or gateway on a taken port (gRPC or /metrics) exits 1 with one line
naming the address and why, no traceback and no gRPC log line."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from moetier.convert import synth
from moetier.errors import Unavailable
from moetier.rpc.serving import bind_problem, bind_socket, listen, new_server
from moetier.settings import load_settings
from services.router.server import create_server as create_router

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("serving") / "tiny", 0)


@pytest.fixture
async def taken() -> AsyncIterator[int]:
    """A port a running router holds (a real gRPC server, as a first `moetier router` would)."""
    settings = load_settings(overrides={"router": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0",
                                                   "metrics_port": 0, "id": "router"}}, environ={})
    router, port = create_router(settings, "127.0.0.1:0")
    await router.start()
    try:
        yield port
    finally:
        await router.stop(0)


def run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    env["MOETIER_DATA_DIR"] = str(tmp / "data")
    return subprocess.run([sys.executable, "-m", "moetier.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=90)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "add_port" not in out, out
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 1 and r.stderr.splitlines()[-1] == errors[0], out
    return errors[0]


@pytest.mark.parametrize("command,what", [("router", "router"), ("expert-store", "expert store"),
                                          ("dense-worker", "dense worker")])
async def test_a_second_service_on_a_taken_port_exits_with_one_line(taken: int, model: Path, tmp_path: Path,
                                                                     command: str, what: str) -> None:
    argv = [command, "--bind", f"127.0.0.1:{taken}", "--metrics-port", "0"]
    if command != "router":
        argv += ["--model", str(model), "--router", ""]
    r = await asyncio.to_thread(run, argv, tmp_path)
    assert one_line_error(r) == (f"moetier {command}: error: {what}: cannot listen on 127.0.0.1:{taken}: "
                                 "address already in use")


async def test_a_taken_metrics_port_exits_with_one_line_before_anything_starts(taken: int, model: Path,
                                                                               tmp_path: Path) -> None:
    r = await asyncio.to_thread(run, ["dense-worker", "--model", str(model), "--router", "", "--bind",
                                      "127.0.0.1:0", "--metrics-port", str(taken)], tmp_path)
    assert one_line_error(r) == (f"moetier dense-worker: error: dense worker: cannot serve /metrics on "
                                 f"127.0.0.1:{taken}: address already in use")
    assert "warm" not in r.stderr.lower()


async def test_a_gateway_on_a_taken_port_exits_with_one_line(taken: int, model: Path, tmp_path: Path) -> None:
    r = await asyncio.to_thread(run, ["gateway", "--model", str(model), "--bind", f"127.0.0.1:{taken}"], tmp_path)
    assert one_line_error(r) == f"moetier gateway: error: gateway: cannot listen on 127.0.0.1:{taken}: " \
                                "address already in use"
    assert "listening on" not in r.stderr  # nothing claims to listen


async def test_listen_names_the_address_and_why(taken: int) -> None:
    server = new_server()
    with pytest.raises(Unavailable, match=rf"^router: cannot listen on 127\.0\.0\.1:{taken}: address already in use$"):
        listen(server, f"127.0.0.1:{taken}", "router")
    with pytest.raises(Unavailable, match=r"cannot listen on nosuch\.invalid:1: cannot resolve 'nosuch\.invalid'"):
        listen(server, "nosuch.invalid:1", "router")
    port = listen(server, "127.0.0.1:0", "router")  # port 0: any free port, as before
    await server.start()
    try:
        assert port > 0 and bind_problem(f"127.0.0.1:{port}") == "address already in use"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await asyncio.wait_for(ch.channel_ready(), 5)
    finally:
        await server.stop(0)
    with pytest.raises(Unavailable, match=f"gateway: cannot listen on 127.0.0.1:{taken}"):
        bind_socket(f"127.0.0.1:{taken}", "gateway")
    sock = bind_socket("127.0.0.1:0", "gateway")
    assert sock.family == socket.AF_INET and sock.getsockname()[1] > 0
    sock.close()
