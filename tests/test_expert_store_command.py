"""`moetier expert-store` as a real process: serves before any router exists, registers once
one comes up, exposes /metrics, stops cleanly on SIGTERM and saves its usage history."""

from __future__ import annotations

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
from test_cluster import members, start_router

from moetier.convert import synth
from moetier.launch import free_ports
from moetier.rpc.v1 import expert_store_pb2 as pb
from moetier.rpc.v1 import expert_store_pb2_grpc as pb_grpc
from moetier.rpc.v1 import router_pb2
from moetier.weights.container import Container

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent


async def wait_serving(address: str, proc: subprocess.Popen[str], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    async with grpc.aio.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the expert store did not come up"
            await asyncio.sleep(0.1)


async def test_command_serves_registers_and_stops_on_sigterm(tmp_path: Path) -> None:
    model = synth.write_container("tiny-deepseek_v3", tmp_path / "tiny", 0)
    with Container.open(model) as c:
        identity = c.index.identity
    mirror = tmp_path / "mirror"
    mirror.mkdir()  # an empty mirror: served degraded ("absent"), never fatal
    port, metrics_port, router_port = free_ports(3)  # at once: distinct
    cfg = tmp_path / "store.yaml"
    cfg.write_text("cache:\n  policy: learned\nstorage:\n  queue_depth: 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    env["MOETIER_DATA_DIR"] = str(tmp_path / "data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "expert-store", "--config", str(cfg), "--model", str(model),
         "--budget", "50%", "--mirror", str(mirror), "--buffered", "--bind", f"127.0.0.1:{port}",
         "--metrics-port", str(metrics_port), "--router", f"127.0.0.1:{router_port}", "--id", "store-9"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    router = None
    try:
        await wait_serving(f"127.0.0.1:{port}", proc)  # no router yet: serving regardless
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = await pb_grpc.ExpertStoreStub(ch).Info(pb.InfoRequest(), timeout=2)
        assert (info.store_id, info.model_id, info.policy, info.budget_bytes) == ("store-9", identity, "learned",
                                                                                 8 * 8192)
        assert [(d.name, d.state) for d in info.disks] == [("primary", "ok"), ("mirror0", "absent")]
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode())
        assert "moetier_expert_store_budget_bytes 65536.0" in text
        assert 'moetier_expert_store_policy_info{policy="learned"} 1.0' in text

        router, _ = await start_router(router_port)
        deadline = time.monotonic() + 15
        while "store-9" not in (found := await members(router_port)):
            assert time.monotonic() < deadline, "the store never registered"
            await asyncio.sleep(0.1)
        m = found["store-9"]
        assert (m.kind, m.address, m.model_id, m.metrics_address) == (
            router_pb2.MEMBER_KIND_EXPERT_STORE, f"127.0.0.1:{port}", identity, f"127.0.0.1:{metrics_port}")
        assert [(r.layer, r.first, r.last) for r in m.owned] == [(1, 0, 8), (2, 0, 8)]

        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0, out
        assert "expert store stopping" in out and "expert store stopped" in out
        assert (tmp_path / "data" / "history" / "store-9.hist").is_file()  # saved on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if router is not None:
            await router.stop(1)
