"""`moetier router`: a real process, its flags, health SERVING, a clean stop on SIGTERM."""

from __future__ import annotations

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

from moetier.launch import free_ports

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parent.parent


def test_router_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, metrics_port = free_ports(2)  # at once: distinct
    cfg = tmp_path / "c.yaml"
    cfg.write_text("queue_capacity: 3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "router", "--config", str(cfg), "--bind", f"127.0.0.1:{port}",
         "--metrics-port", str(metrics_port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 15
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    break
                except grpc.RpcError:
                    assert proc.poll() is None, proc.communicate()[0]
                    assert time.monotonic() < deadline, "router did not come up"
                    time.sleep(0.1)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
        assert "moetier_router_queue_capacity 3.0" in text  # the config file reached the router
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
        assert "router stopping" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
