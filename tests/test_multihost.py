"""Several hosts without loopback: every service in a Linux network namespace of its own (a veth
pair each, all on one bridge in a namespace of their own, an address each; `lo` left DOWN in every
service's namespace, so nothing can reach 127.0.0.1), each with its own data directory and its own
model directory (a store's holds only the expert files of its shard; the dense workers' and the
gateway's hold none): no code may assume loopback or a shared filesystem.

The cluster: router, gateway, two dense workers (experts placed by the router's map), three
expert stores: `a` (the layer-1 expert file only), `b` (the layer-2 file only), `c` (a full copy,
owning experts 0-3 of both layers: overlapping a and b). The test (in the root namespace, on the
bridge by a veth of its own) checks that

- greedy chat through the gateway equals the single-store output (the in-process engine's,
  which tests/test_cluster_e2e.py holds equal to one store's);
- requests spread over both workers, and killing one worker mid-stream fails only its streams;
- killing store a mid-stream (c alive) fails only streams that need layer 1's experts 4-7, with
  UNAVAILABLE naming the layer and the experts; the others finish with the single-store text;
- killing store c mid-stream fails no request (a and b own every expert it had);
- killing a too fails every request (layer 1's experts 4-7 have no owner) with the message,
  within the deadline;
- a restarted a is taken back into the placement map, and output is the single-store one again.

Made and removed by the test itself, as root; skipped with the reason where namespaces cannot be
made."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from moetier.convert import synth
from moetier.engine import Engine
from moetier.launch import grpc_healthy
from moetier.model.sampling import SamplingParams
from moetier.rpc.v1 import generate_pb2, router_pb2, router_pb2_grpc
from services.gateway.model import ServedModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny-mla"
START_S = 240.0  # one service's start on two busy cores


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"mtprobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Net:
    """A bridge in a namespace of its own; `host(name)` adds a namespace on it with one address."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.hub = f"mt{self.tag}hub"
        self.namespaces: list[str] = []
        self.client_link = f"mt{self.tag}cl"
        self._n = 0
        _ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        self._in(self.hub, "link", "add", "br0", "type", "bridge")
        self._in(self.hub, "link", "set", "br0", "up")

    def _in(self, ns: str, *args: str) -> None:
        _ip("-n", ns, *args)

    def _veth(self, outer_ns: str | None, outer: str, inner_ns: str, address: str) -> None:
        """A veth pair: `eth0` with `address` in inner_ns, its peer on the bridge."""
        peer = f"mt{self.tag}p{self._n}"
        self._n += 1
        _ip("link", "add", outer, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.hub)
        self._in(self.hub, "link", "set", peer, "master", "br0")
        self._in(self.hub, "link", "set", peer, "up")
        if outer_ns is not None:
            _ip("link", "set", outer, "netns", inner_ns)
            self._in(inner_ns, "link", "set", outer, "name", "eth0")
            self._in(inner_ns, "addr", "add", f"{address}/24", "dev", "eth0")
            self._in(inner_ns, "link", "set", "eth0", "up")
        else:  # the root namespace: the test's own leg
            _ip("addr", "add", f"{address}/24", "dev", outer)
            _ip("link", "set", outer, "up")

    def host(self, name: str, last_octet: int) -> tuple[str, str]:
        """(namespace, address): `lo` stays down in it."""
        ns = f"mt{self.tag}{name}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        address = f"{self.subnet}.{last_octet}"
        self._veth("ns", f"mt{self.tag}v{self._n}", ns, address)
        return ns, address

    def client(self) -> str:
        address = f"{self.subnet}.254"
        self._veth(None, self.client_link, "", address)
        return address

    def close(self) -> None:
        _ip("link", "del", self.client_link, check=False)
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth ends
            _ip("netns", "del", ns, check=False)


class Service:
    def __init__(self, name: str, ns: str, argv: list[str], env: dict[str, str], log: Path,
                 health: Any) -> None:
        self.name, self.ns, self.argv, self.env, self.log, self.health = name, ns, argv, env, log, health
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOETIER_")}
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-m", "moetier.cli",
                                          *self.argv], env={**base, **self.env}, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.health():
            assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} not healthy in {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def given(model: Path, root: Path, layer_files: list[str]) -> Path:
    """A model directory of its own: every file of the container but the expert files other than
    `layer_files`. Copies, not links: nothing is shared."""
    for src in model.rglob("*"):
        rel = src.relative_to(model)
        if src.is_dir() or (rel.parts[0] == "experts" and src.suffix == ".bin" and src.name not in layer_files):
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return root


def expected(model: Path, served: ServedModel, messages: list[dict[str, str]], max_tokens: int) -> str:
    tok = served.tokenizer
    assert tok.chat_template is not None
    ids = tok.encode(tok.chat_template.render(messages), add_special_tokens=False)
    with Engine.open(model, budget="100%") as engine:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=tok.eos_token_ids,
                                ignore_eos=True)
        return tok.decode([g.token for g in engine.generate(ids, params)])


PROMPTS = [[{"role": "user", "content": f"Question {i}: where do the experts of layer {i} live?"}] for i in range(4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_container("tiny-deepseek_v3", tmp_path_factory.mktemp("multihost") / MODEL, 0)


@contextlib.contextmanager
def cluster(model: Path, tmp: Path) -> Iterator[dict[str, Any]]:
    problem = _netns_problem()
    if problem is not None:
        pytest.skip(problem)
    net = Net()
    services: dict[str, Service] = {}
    try:
        net.client()
        hosts = {name: net.host(name, octet) for name, octet in (
            ("router", 2), ("gateway", 3), ("wk0", 10), ("wk1", 11), ("sta", 20), ("stb", 21), ("stc", 22))}
        router = f"{hosts['router'][1]}:50051"
        common = {"MOETIER_ROUTER__ADDRESS": router, "MOETIER_HEARTBEAT_INTERVAL_S": "0.2",
                  "MOETIER_MEMBER_EXPIRY_S": "10", "MOETIER_CACHE__POLICY": "lru",
                  "MOETIER_MODEL__EXPERT_CACHE": "100%", "MOETIER_INFERENCE__EXPERT_PLACEMENT": "router",
                  "MOETIER_INFERENCE__EXPERT_TIMEOUT_S": "20", "MOETIER_GATEWAY__REQUEST_TIMEOUT_S": "120"}
        files = sorted(p.name for p in (model / "experts").glob("*.bin"))
        shards = {"sta": ([files[0]], "all"), "stb": ([files[1]], "all"), "stc": (files, "1-2:0-3")}

        def add(name: str, argv: list[str], env: dict[str, str], health: Any) -> None:
            ns, _ = hosts[name]
            own = tmp / name
            own.mkdir()
            mdir = given(model, own / "model", shards[name][0] if name in shards else [])
            services[name] = Service(name, ns, argv, {**common, "MOETIER_DATA_DIR": str(own / "data"),
                                                      "MOETIER_MODEL__PATH": str(mdir), **env},
                                     own / "service.log", health)

        add("router", ["router"], {"MOETIER_ROUTER__BIND": router}, lambda: grpc_healthy(router))
        for name, (_, owned) in shards.items():
            a = f"{hosts[name][1]}:50053"
            add(name, ["expert-store"], {"MOETIER_EXPERT_STORE__BIND": a, "MOETIER_EXPERT_STORE__ADDRESS": a,
                                         "MOETIER_EXPERT_STORE__ID": f"store-{name[-1]}",
                                         "MOETIER_STORAGE__OWNED_EXPERTS": owned,
                                         # equal weights, not a probe a busy machine skews: the share
                                         # each store wins is then the hash's alone, the same every run
                                         "MOETIER_STORAGE__MIRROR_WEIGHTS": "[1.0]"},
                lambda a=a: grpc_healthy(a))
        for name in ("wk0", "wk1"):
            a = f"{hosts[name][1]}:50052"
            add(name, ["dense-worker"], {"MOETIER_DENSE_WORKER__BIND": a, "MOETIER_DENSE_WORKER__ADDRESS": a,
                                         "MOETIER_DENSE_WORKER__ID": name}, lambda a=a: grpc_healthy(a))
        gw = f"{hosts['gateway'][1]}:8000"
        add("gateway", ["gateway"], {"MOETIER_GATEWAY__BIND": gw, "MOETIER_MODEL__NAME": MODEL},
            lambda: _http_ok(f"http://{gw}/health"))
        for s in services.values():  # all at once: each retries what it needs until it answers
            s.start()
        for s in services.values():
            s.wait_healthy()
        yield {"services": services, "router": router, "gateway": f"http://{gw}"}
    finally:
        for s in services.values():
            s.stop()
        net.close()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def placement(router: str) -> router_pb2.PlacementResponse:
    with grpc.insecure_channel(router) as ch:
        return router_pb2_grpc.RouterStub(ch).Placement(router_pb2.PlacementRequest(), timeout=5)


def wait_stores(router: str, ids: set[str], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while {s.member_id for s in placement(router).stores} != ids:
        assert time.monotonic() < deadline, f"placement map never became {sorted(ids)}"
        time.sleep(0.2)


def chat(url: str, messages: list[dict[str, str]], max_tokens: int, stream: bool = False,
         on_first: Any = None) -> tuple[int, str]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": stream}
    with httpx.Client(base_url=url, timeout=180) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        text, failed = [], ""
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:  # failed before its first token: an error body, not a stream
                r.read()
                return r.status_code, r.text
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    failed = json.dumps(msg["error"])
                    continue
                for ch in msg.get("choices", []):
                    text.append(ch.get("delta", {}).get("content") or "")
                if on_first is not None:
                    on_first()
                    on_first = None
            return (r.status_code if not failed else 503), failed or "".join(text)


def test_a_cluster_across_namespaces(model: Path, tmp_path: Path) -> None:
    served = ServedModel.from_dir(model, MODEL)
    n = 64
    want = [expected(model, served, p, n) for p in PROMPTS]
    with cluster(model, tmp_path) as c:
        url, router, svc = c["gateway"], c["router"], c["services"]
        wait_stores(router, {"store-a", "store-b", "store-c"})
        with grpc.insecure_channel(router) as ch:
            status = router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)
        placed = {m.member_id: m.placed_experts for m in status.members if m.kind == router_pb2.MEMBER_KIND_EXPERT_STORE}
        assert all(placed[s] > 0 for s in ("store-a", "store-b", "store-c")) and sum(placed.values()) == 16, placed

        # greedy chat through the gateway is the single-store output, whichever worker serves it
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: chat(url, p, n), PROMPTS))
        assert got == [(200, w) for w in want]

        def streams_killing(victim: str) -> list[tuple[int, str]]:
            """Every prompt streamed at once; `victim` killed when the first one has its first chunk."""
            done = [False]

            def kill() -> None:
                if not done[0]:
                    done[0] = True
                    svc[victim].kill()

            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(chat, url, p, n, True, kill if i == 0 else None) for i, p in enumerate(PROMPTS)]
                return [f.result() for f in futures]

        # a dies mid-stream while c lives: a stream whose layer-1 experts c also owns (0-3) goes
        # on, bit for bit; one that needs 4-7 fails, naming them -- none hangs, none is wrong
        for (status, text), w in zip(streams_killing("sta"), want, strict=True):
            assert (status, text) == (200, w) or (status == 503 and "layer 1" in text
                                                  and "no live expert store holds experts" in text), text
        svc["sta"].start()
        svc["sta"].wait_healthy()
        wait_stores(router, {"store-a", "store-b", "store-c"})

        # c dies mid-stream: a and b own every expert it had, so no stream fails
        assert streams_killing("stc") == [(200, w) for w in want]

        # a dies too: layer 1's experts have no owner left; every request fails, naming them
        svc["sta"].kill()
        status, body = chat(url, PROMPTS[0], n)
        assert status == 503, body
        assert "layer 1" in body and "no live expert store holds experts" in body, body

        # a comes back and is taken into the map: output is the single-store one again
        svc["sta"].start()
        svc["sta"].wait_healthy()
        wait_stores(router, {"store-a", "store-b"})
        deadline = time.monotonic() + 60
        while (got1 := chat(url, PROMPTS[1], n))[0] != 200:
            assert time.monotonic() < deadline, got1
            time.sleep(0.5)
        assert got1 == (200, want[1])


def test_a_workers_death_fails_only_its_streams(model: Path, tmp_path: Path) -> None:
    with cluster(model, tmp_path) as c:
        router, svc = c["router"], c["services"]
        served = ServedModel.from_dir(model, MODEL)
        tok = served.tokenizer
        assert tok.chat_template is not None
        prompts = [tok.encode(tok.chat_template.render(p), add_special_tokens=False) for p in PROMPTS]
        results: dict[int, tuple[str, str]] = {}  # request -> (worker, outcome)
        first_tokens: dict[int, str] = {}

        def generate(i: int) -> None:
            req = generate_pb2.GenerateRequest(request_id=f"mh-{i}", prompt_ids=prompts[i],
                                               sampling=generate_pb2.SamplingParams(temperature=0, top_p=1.0,
                                                                                    max_tokens=400))
            worker = ""
            with grpc.insecure_channel(router) as ch:
                try:
                    for m in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=120):
                        worker = worker or m.worker_id
                        first_tokens.setdefault(i, worker)
                    results[i] = (worker, "ok")
                except grpc.RpcError as e:
                    results[i] = (worker, e.code().name)

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(generate, i) for i in range(4)]
            deadline = time.monotonic() + 120
            while len(set(first_tokens.values())) < 2 and time.monotonic() < deadline and len(results) < 4:
                time.sleep(0.01)
            on = dict(first_tokens)
            if len(set(on.values())) == 2:
                svc["wk1"].kill()
            for f in futures:
                f.result()
        assert {w for w, _ in results.values()} == {"wk0", "wk1"}, results  # both workers served
        assert all(outcome == "ok" for worker, outcome in results.values() if worker == "wk0"), results
        assert any(outcome == "UNAVAILABLE" for w, outcome in results.values() if w == "wk1"), results
