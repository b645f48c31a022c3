"""`moetier dense-worker`: a real process in front of an in-process expert store; its flags,
health SERVING, a request served, /metrics, a clean stop on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moetier.cli import build_parser
from moetier.commands.dense_worker import build_settings
from moetier.convert import synth
from moetier.launch import free_ports
from moetier.rpc.v1 import dense_worker_pb2_grpc, generate_pb2
from moetier.settings import load_settings
from services.expert_store.server import create_server as create_store

pytestmark = pytest.mark.timeout(240)  # a process's start (imports, kernel warm-up) on two busy cores
ROOT = Path(__file__).resolve().parent.parent


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["dense-worker", *argv])


def test_flags_reach_the_settings(tmp_path: Path) -> None:
    s = build_settings(parse("--model", str(tmp_path), "--store", "10.0.0.2:7000", "--router", "",
                             "--bind", "0.0.0.0:6000", "--metrics-port", "0", "--id", "w7"))
    assert s.model.path == tmp_path and s.expert_store.address == "10.0.0.2:7000" and s.router.address == ""
    assert (s.dense_worker.bind, s.dense_worker.address, s.dense_worker.id) == ("0.0.0.0:6000", "127.0.0.1:6000", "w7")
    assert s.dense_worker.metrics_port == 0


async def test_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    model = synth.write_container("tiny-qwen2_moe", tmp_path / "m", 0)
    store_settings = load_settings(overrides={
        "model": {"path": str(model), "expert_cache": "100%"}, "cache": {"policy": "lru"},
        "data_dir": str(tmp_path / "data"), "router": {"bind": "127.0.0.1:0", "address": "", "metrics_port": 0,
                                                       "id": "router"},
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "s"}},
        environ={})
    store, sport = create_store(store_settings, "127.0.0.1:0", threads=1)
    await store.start()
    port, metrics_port = free_ports(2)  # at once: distinct
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\ninference:\n  max_batch_size: 3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "dense-worker", "--config", str(cfg), "--model", str(model),
         "--store", f"127.0.0.1:{sport}", "--router", "", "--bind", f"127.0.0.1:{port}",
         "--metrics-port", str(metrics_port), "--id", "w-cmd"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 180  # started, however busy the machine (not a timing check)
            while True:
                try:
                    resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "the dense worker did not come up"
                await asyncio.sleep(0.1)
            stub = dense_worker_pb2_grpc.DenseWorkerStub(ch)
            req = generate_pb2.GenerateRequest(prompt_ids=[5, 6, 7], sampling=generate_pb2.SamplingParams(
                temperature=0, top_p=1, max_tokens=4))
            msgs = [m async for m in stub.Generate(req, timeout=20)]
            assert len(msgs) == 4 and msgs[0].worker_id == "w-cmd"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
        assert "moetier_dense_worker_max_batch_requests 3.0" in text  # the config file reached the worker
        assert "moetier_dense_worker_generated_tokens_total 4.0" in text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, out
        assert "dense worker stopping" in out and "dense worker stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await store.stop(0)
