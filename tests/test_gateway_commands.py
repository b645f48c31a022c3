"""`moetier chat` against a served gateway, and `moetier gateway` as a real process."""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from helpers_gateway import MODEL, REPLY, Emit, Fail, Served, make_model_dir, served

from moetier.commands import chat
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Served]:
    with served(ServedModel.from_dir(model_dir)) as s:
        yield s


@pytest.fixture
def gw(server: Served) -> Served:
    server.fake.reset()
    return server


def _lines(*lines: str) -> Callable[[str], str]:
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def _chat(url: str, *lines: str, **kw: object) -> tuple[int, str, str]:
    args = argparse.Namespace(url=url, api_key=None, model=None, system=None, max_tokens=None, temperature=None)
    for k, v in kw.items():
        setattr(args, k, v)
    out, err = io.StringIO(), io.StringIO()
    rc = chat.run(args, read=_lines(*lines), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_chat_multi_turn(gw: Served, model_dir: Path) -> None:
    rc, out, err = _chat(gw.url, "Hi", "", "Again", system="Be brief.")
    assert rc == 0, err
    assert out.count(REPLY) == 2
    assert f"chatting with {MODEL}" in err
    tok = ServedModel.from_dir(model_dir).tokenizer
    second = tok.decode(gw.fake.requests[1].prompt_ids)
    assert all(s in second for s in ("Be brief.", "Hi", REPLY, "Again"))  # the history went along


def test_chat_exit_reset_and_unknown_command(gw: Served) -> None:
    rc, out, err = _chat(gw.url, "Hi", "/reset", "/nope", "Hello", "/exit", "never sent")
    assert rc == 0 and "(conversation cleared)" in err and "unknown command /nope" in err
    assert out.count(REPLY) == 2
    assert len(gw.fake.requests) == 2 and len(gw.fake.requests[1].prompt_ids) < 20  # history forgotten


def test_chat_error_lines(gw: Served) -> None:
    rc, _, err = _chat(gw.url, "Hi", model="nope")
    assert rc == 0 and "error: 404: The model `nope` does not exist" in err
    gw.fake.script = lambda r: [Emit([40]), Fail(grpc.StatusCode.UNAVAILABLE, "worker died")]
    _, _, err = _chat(gw.url, "Hi")
    assert "error: the server failed mid-reply: router: worker died" in err
    gw.fake.script = lambda r: [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")]
    _, _, err = _chat(gw.url, "Hi")
    assert "error: 429: router: queue full" in err


def test_chat_server_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = _chat(f"http://127.0.0.1:{port}", "Hi")
    assert rc == 1 and "error: cannot reach the server at http://127.0.0.1:" in err


def test_gateway_command_serves_and_shuts_down(model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port, dead_router = s.getsockname()[1], f"127.0.0.1:{s.getsockname()[1] + 1}"
    config = tmp_path / "moetier.yaml"
    config.write_text("gateway:\n  api_key: from-the-file\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "gateway", "--config", str(config), "--model", str(model_dir),
         "--bind", f"127.0.0.1:{port}", "--router", dead_router, "--api-key", "from-the-flag"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-the-flag"})
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 503  # no router there
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(15) in (0, -signal.SIGTERM)
        assert proc.stdout is not None and "gateway stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
