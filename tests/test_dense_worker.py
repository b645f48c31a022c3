"""The dense worker, in process on port 0, in front of the real expert store (also in process),
over the tiny synth containers of an MLA (deepseek_v3) and a GQA (qwen3_moe) architecture.

Greedy equality with the in-process engine (alone, and in a batch of 8 of different lengths
with chunked prefill), sampling with seeds, penalties, logprobs, stop ids and limits; 50
streams cancelled midway; queue overflow; a killed and a slow expert store; the prefix
cache across a worker restart and with corrupt files; validation; router membership; the
documented metrics.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetier.cli import main
from moetier.convert import synth
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.prefix import block_hashes
from moetier.prefix_cache import entry_key
from moetier.rpc.errors import RETRY_AFTER_KEY
from moetier.rpc.v1 import dense_worker_pb2, dense_worker_pb2_grpc, generate_pb2
from moetier.rpc.v1 import expert_store_pb2 as spb
from moetier.rpc.v1 import expert_store_pb2_grpc as spb_grpc
from moetier.settings import Settings, load_settings
from services.dense_worker import metrics as metrics_module
from services.dense_worker.server import WorkerServer
from services.dense_worker.server import create_server as create_worker
from services.expert_store.server import StoreServer
from services.expert_store.server import create_server as create_store

pytestmark = pytest.mark.timeout(60)

ARCHS = ("deepseek_v3", "qwen3_moe", "qwen3_next")  # MLA, GQA, hybrid linear attention (a fixed-size state)
UNAVAILABLE, INVALID, EXHAUSTED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
                                   grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense-worker")
    return {arch: synth.write_container(f"tiny-{arch}", root / arch, 0) for arch in ARCHS}


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> AsyncIterator[dict[str, Engine]]:
    opened = {arch: Engine.open(path, budget="100%") for arch, path in models.items()}
    yield opened  # type: ignore[misc]
    for e in opened.values():
        e.close()


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def settings_for(model: Path, tmp: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "model": {"path": str(model), "expert_cache": "100%"},
        "cache": {"policy": "lru"},
        "data_dir": str(tmp / "data"),
        "router": {"bind": "127.0.0.1:0", "address": "", "metrics_port": 0, "id": "router"},
        "expert_store": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "store-t"},
        "dense_worker": {"bind": "127.0.0.1:0", "address": "127.0.0.1:0", "metrics_port": 0, "id": "worker-t"},
        # speculative decoding off: these tests count steps and rows (tests/test_dense_worker_spec.py has it on)
        "inference": {"max_batch_size": 8, "max_waiting": 64, "prefill_chunk": 16, "expert_timeout_s": 2.0,
                      "prefix_cache_dir": str(tmp / "prefix"), "speculative_tokens": 0},
        "heartbeat_interval_s": 0.1,
    }
    return load_settings(overrides=_merge(base, over), environ={})


@dataclass
class Cluster:
    settings: Settings
    store: StoreServer | None
    store_port: int
    worker: WorkerServer
    channel: grpc.aio.Channel
    stub: dense_worker_pb2_grpc.DenseWorkerStub

    def metrics(self) -> dict[str, float]:
        """Scraped samples of the worker (labels joined into the name: name{k=v,...})."""
        self.worker.core.refresh_metrics()
        out = {}
        for fam in text_string_to_metric_families(generate_latest(self.worker.core.metrics.registry).decode()):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    async def load(self) -> dense_worker_pb2.WorkerLoad:
        return await self.stub.Load(dense_worker_pb2.LoadRequest(), timeout=5)


async def start_store(settings: Settings, bind: str = "127.0.0.1:0") -> tuple[StoreServer, int]:
    store, port = create_store(settings, bind, threads=1)
    await store.start()
    return store, port


@asynccontextmanager
async def cluster(model: Path, tmp: Path, *, store: bool = True, register: bool = False,
                  store_address: str | None = None, **over: Any) -> AsyncIterator[Cluster]:
    settings = settings_for(model, tmp, **over)
    st, port = (await start_store(settings)) if store else (None, 0)
    addr = store_address or f"127.0.0.1:{port}"
    settings = settings.model_copy(update={"expert_store": settings.expert_store.model_copy(update={"address": addr})})
    worker, wport = create_worker(settings, "127.0.0.1:0", register=register)
    await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{wport}")
    c = Cluster(settings, st, port, worker, channel, dense_worker_pb2_grpc.DenseWorkerStub(channel))
    try:
        yield c
    finally:
        await channel.close()
        await c.worker.stop(0)
        if c.store is not None:
            await c.store.stop(0)


def request(prompt: Sequence[int], max_tokens: int = 16, *, temperature: float = 0.0, rid: str = "r",
            **sampling: Any) -> generate_pb2.GenerateRequest:
    sampling.setdefault("top_p", 1.0)
    return generate_pb2.GenerateRequest(request_id=rid, prompt_ids=[int(t) for t in prompt],
                                        sampling=generate_pb2.SamplingParams(temperature=temperature,
                                                                             max_tokens=max_tokens, **sampling))


async def collect(stub: dense_worker_pb2_grpc.DenseWorkerStub, req: generate_pb2.GenerateRequest,
                  timeout: float = 30) -> list[generate_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(req, timeout=timeout)]


def tokens(msgs: list[generate_pb2.GenerateResponse]) -> list[int]:
    return [t.token_id for m in msgs for t in m.tokens]


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(7, 500, n)]


def reference(engine: Engine, prompt: Sequence[int], params: SamplingParams) -> list[int]:
    return [g.token for g in engine.generate(prompt, params)]


async def wait_for(cond: Any, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# ---- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_alone_equals_moetier_generate(arch: str, models: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prompt = prompt_of(21, 1)
    capsys.readouterr()
    assert main(["generate", "--model", str(models[arch]), "--prompt-ids", ",".join(map(str, prompt)),
                 "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--show-ids"]) == 0
    expected = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    async with cluster(models[arch], tmp_path) as c:
        msgs = await collect(c.stub, request(prompt, 24))
        assert tokens(msgs) == expected
        first = msgs[0]
        assert first.prompt_tokens == len(prompt) and first.cached_prompt_tokens == 0
        assert first.worker_id == "worker-t" and first.queue_ns > 0
        assert msgs[-1].finish_reason == "length" and all(not m.HasField("finish_reason") for m in msgs[:-1])
        assert all(m.timings.step_ns > 0 and m.timings.expert_ns > 0 for m in msgs)
        m = c.metrics()
        # 21 prompt tokens in chunks of 16: 2 prefill steps, then 23 decode steps
        assert m["moetier_dense_worker_steps_total"] == 25
        assert m["moetier_dense_worker_generated_tokens_total"] == 24
        assert m["moetier_dense_worker_finished_requests_total{finish_reason=length}"] == 1
        # a roomy store shares its experts (storage.share): the worker computes the calls itself
        calls = 25 * len(c.worker.core.model.args.moe_layer_ids)
        assert m["moetier_dense_worker_expert_calls_total{outcome=shared}"] == calls
        assert m["moetier_dense_worker_expert_calls_total{outcome=ok}"] == 0


async def test_the_next_step_starts_before_the_last_tokens_are_streamed(models: dict[str, Path], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop starts step n + 1 before it hands out step n's tokens (the step thread does not
    wait for the streaming), and the tokens still arrive in order, the same as one by one."""
    from services.dense_worker.batcher import Batcher

    events: list[str] = []
    start, emit = Batcher._start_step, Batcher._emit

    def recorded_start(self: Batcher, loop: asyncio.AbstractEventLoop) -> Any:
        events.append("start")
        return start(self, loop)

    def recorded_emit(self: Batcher, r: Any, outputs: Any) -> None:
        events.append("emit")
        emit(self, r, outputs)

    monkeypatch.setattr(Batcher, "_start_step", recorded_start)
    monkeypatch.setattr(Batcher, "_emit", recorded_emit)
    prompt = prompt_of(9, 3)
    async with cluster(models["qwen3_moe"], tmp_path) as c:
        msgs = await collect(c.stub, request(prompt, 6))
    assert len(tokens(msgs)) == 6 and msgs[-1].finish_reason == "length"
    # one prefill step (9 tokens < the 16-token chunk) makes the first token, five decode steps the rest:
    # every step but the last is followed by the next one's start, then by its own outputs
    assert events == ["start"] + ["start", "emit"] * 5 + ["emit"]


@pytest.mark.parametrize("arch", ARCHS)
async def test_batch_of_8_different_lengths(arch: str, models: dict[str, Path], engines: dict[str, Engine],
                                            tmp_path: Path) -> None:
    """8 concurrent requests, prompts of 3..70 tokens (chunked prefill interleaved with decoding),
    greedy and seeded sampling: each equals its request served alone in-process."""
    lengths = [3, 70, 9, 33, 1, 47, 16, 25]
    cases = []
    for i, n in enumerate(lengths):
        temp = 0.0 if i % 2 == 0 else 0.9
        params = SamplingParams(temperature=temp, seed=100 + i, max_tokens=12 + i, ignore_eos=True)
        cases.append((prompt_of(n, 10 + i), params))
    expected = [reference(engines[arch], p, params) for p, params in cases]
    async with cluster(models[arch], tmp_path) as c:
        reqs = [request(p, params.max_tokens, temperature=params.temperature, seed=params.seed, rid=f"b{i}")
                for i, (p, params) in enumerate(cases)]
        got = await asyncio.gather(*(collect(c.stub, r) for r in reqs))
        for i, msgs in enumerate(got):
            assert tokens(msgs) == expected[i], f"request {i} (prompt {lengths[i]} tokens)"
        m = c.metrics()
        assert m["moetier_dense_worker_batch_rows_sum"] > m["moetier_dense_worker_steps_total"]  # batching happened
        assert m["moetier_dense_worker_batch_sequences_bucket{le=4.0}"] < m["moetier_dense_worker_steps_total"]


async def test_sampling_options_match_in_process(models: dict[str, Path], engines: dict[str, Engine],
                                                 tmp_path: Path) -> None:
    prompt = prompt_of(12, 3)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, presence_penalty=0.5, frequency_penalty=0.3,
                            seed=9, max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=3)
    expected = list(engines["qwen3_moe"].generate(prompt, params))
    async with cluster(models["qwen3_moe"], tmp_path) as c:
        msgs = await collect(c.stub, request(prompt, 20, temperature=0.7, top_p=0.9, top_k=40, presence_penalty=0.5,
                                             frequency_penalty=0.3, seed=9, logprobs=True, top_logprobs=3))
        got = [t for m in msgs for t in m.tokens]
        assert [t.token_id for t in got] == [g.token for g in expected]
        for t, g in zip(got, expected, strict=True):
            assert g.logprob is not None
            assert t.logprob == pytest.approx(g.logprob, abs=1e-6)
            assert [(x.token_id, pytest.approx(x.logprob, abs=1e-6)) for x in t.top_logprobs] == g.top_logprobs
        # a stop id ends the stream with "stop", the stop token included
        stop = [g.token for g in expected][5]
        msgs = await collect(c.stub, request(prompt, 20, temperature=0.7, top_p=0.9, top_k=40, presence_penalty=0.5,
                                             frequency_penalty=0.3, seed=9, stop_token_ids=[stop]))
        ids = tokens(msgs)
        assert ids[-1] == stop and len(ids) == [g.token for g in expected].index(stop) + 1
        assert msgs[-1].finish_reason == "stop"


async def test_invalid_requests(models: dict[str, Path], tmp_path: Path) -> None:
    async with cluster(models["qwen3_moe"], tmp_path, inference={"max_seq_len": 64}) as c:
        bad = {
            "prompt_ids is empty": request([], 4),
            "prompt_ids[1] = 512 is not below the vocab size 512": request([5, 512], 4),
            "exceed this worker's 64 positions": request(prompt_of(60, 0), 5),
            "temperature must be >= 0": request([5, 6], 4, temperature=-1.0),
            "top_p must be in (0, 1]": generate_pb2.GenerateRequest(
                prompt_ids=[5], sampling=generate_pb2.SamplingParams(top_p=1.5, max_tokens=2)),
            "max_tokens must be >= 1": request([5, 6], 0),
            "top_logprobs must be in [0, 20]": request([5, 6], 2, top_logprobs=21),
            "presence_penalty must be in": request([5, 6], 2, presence_penalty=3.0),
            "temperature must be a finite number": request([5, 6], 2, temperature=float("nan")),
            "stop_token_ids: 999 is not below": request([5, 6], 2, stop_token_ids=[999]),
        }
        for why, req in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.stub, req)
            assert e.value.code() == INVALID, why
            assert why in (e.value.details() or ""), (why, e.value.details())
        assert c.metrics()["moetier_dense_worker_rejected_requests_total{reason=invalid}"] == len(bad)
        assert tokens(await collect(c.stub, request(prompt_of(59, 0), 5))) != []  # 59 + 5 = 64: fits


# ---- load and cancellation ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
async def test_cancelled_streams_free_their_kv(arch: str, models: dict[str, Path], tmp_path: Path) -> None:
    async with cluster(models[arch], tmp_path) as c:
        baseline = (await c.load()).kv_bytes
        assert baseline == 0
        calls = [c.stub.Generate(request(prompt_of(5 + i % 30, i), 400, rid=f"c{i}"), timeout=60) for i in range(50)]
        readers = [asyncio.ensure_future(call.read()) for call in calls]
        await wait_for(lambda: _started(readers, 8), 20, "the first batch to produce tokens")

        async def admitted() -> bool:  # the last calls may still be on their way on a busy machine
            load = await c.load()
            return load.running == 8 and load.waiting == 42 and load.kv_bytes > 0

        await wait_for(admitted, 20, "8 running and 42 waiting")
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

        async def freed() -> bool:
            load = await c.load()
            return load.running == 0 and load.waiting == 0 and load.kv_bytes == baseline

        await wait_for(freed, 5, "every sequence to leave")
        t0 = time.monotonic()
        msgs = await collect(c.stub, request(prompt_of(10, 99), 8), timeout=5)
        assert len(tokens(msgs)) == 8 and time.monotonic() - t0 < 5
        m = c.metrics()
        assert m["moetier_dense_worker_finished_requests_total{finish_reason=cancelled}"] == 50
        assert m["moetier_dense_worker_kv_cache_bytes"] == 0 and m["moetier_dense_worker_running_requests"] == 0


async def _started(readers: list[asyncio.Future[Any]], n: int) -> bool:
    return sum(r.done() for r in readers) >= n


async def test_queue_overflow_is_resource_exhausted(models: dict[str, Path], tmp_path: Path) -> None:
    async with cluster(models["qwen3_moe"], tmp_path, inference={"max_batch_size": 1, "max_waiting": 1}) as c:
        a = c.stub.Generate(request([5, 6, 7], 1000, rid="a"), timeout=30)
        await a.read()  # a holds the only batch slot before b arrives (else b may run and a wait)
        b = c.stub.Generate(request([5, 6, 8], 1000, rid="b"), timeout=30)
        await wait_for(lambda: _waiting(c, 1), 5, "b to wait")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(c.stub, request([5, 6, 9], 4, rid="c"))
        assert e.value.code() == EXHAUSTED
        assert "1 running (max 1), 1 waiting (max 1)" in (e.value.details() or "")
        retry = dict(e.value.trailing_metadata() or ())[RETRY_AFTER_KEY]
        assert int(retry) > 0
        a.cancel()
        b.cancel()
        assert c.metrics()["moetier_dense_worker_rejected_requests_total{reason=queue_full}"] == 1


async def _waiting(c: Cluster, n: int) -> bool:
    return (await c.load()).waiting == n


async def _running(c: Cluster, n: int) -> bool:
    return (await c.load()).running == n


@asynccontextmanager
async def step_held(c: Cluster) -> AsyncIterator[None]:
    """No step boundary inside the block: the step thread runs a wait queued behind the current
    step, so the next step (and the boundary before it) waits too."""
    entered, go_on = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        go_on.wait(20)

    held = asyncio.ensure_future(c.worker.core.batcher.run_in_step_thread(hold))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        yield
    finally:
        go_on.set()
        await held


async def test_a_cancelled_sequence_frees_its_admission_slot_before_the_step_boundary(
        models: dict[str, Path], tmp_path: Path) -> None:
    """The router hands a cancelled request's slot on at once, so the next call can arrive before
    the worker's next step boundary: it must be admitted, not refused as full. The cancelled
    sequence's KV still goes at that boundary."""
    async with cluster(models["qwen3_moe"], tmp_path, inference={"max_batch_size": 1, "max_waiting": 0}) as c:
        a = c.stub.Generate(request([5, 6, 7], 1000, rid="a"), timeout=30)
        await a.read()  # a holds the only slot
        async with step_held(c):
            a.cancel()
            await wait_for(lambda: _running(c, 0), 5, "the cancelled sequence to stop counting as running")
            load = await c.load()
            assert load.kv_bytes > 0 and load.waiting == 0  # its KV waits for the boundary
            b = c.stub.Generate(request([5, 6, 8], 4, rid="b"), timeout=30)
            first = asyncio.ensure_future(b.read())
            await wait_for(lambda: _waiting(c, 1), 5, "b to be admitted while the step is held")
            assert not first.done()
        msgs = [await first]
        while msgs[-1] is not grpc.aio.EOF:
            msgs.append(await b.read())
        assert len(tokens(msgs[:-1])) == 4 and msgs[-2].finish_reason == "length"
        m = c.metrics()
        assert m["moetier_dense_worker_rejected_requests_total{reason=queue_full}"] == 0
        assert m["moetier_dense_worker_finished_requests_total{finish_reason=cancelled}"] == 1
        assert (await c.load()).kv_bytes == 0


# ---- the expert store failing ------------------------------------------------------------------
async def test_store_killed_mid_request_then_back(models: dict[str, Path], engines: dict[str, Engine],
                                                  tmp_path: Path) -> None:
    async with cluster(models["deepseek_v3"], tmp_path) as c:
        call = c.stub.Generate(request(prompt_of(8, 5), 2000, rid="long"), timeout=30)
        await call.read()
        assert c.store is not None
        t0 = time.monotonic()
        await c.store.stop(0)
        c.store = None
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while await call.read() != grpc.aio.EOF:
                pass
        assert e.value.code() == UNAVAILABLE and "expert store" in (e.value.details() or "")
        assert time.monotonic() - t0 < c.settings.inference.expert_timeout_s + 1
        # while it is down: a clear UNAVAILABLE, at once
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(c.stub, request([5, 6, 7], 3))
        assert e.value.code() == UNAVAILABLE
        # back on the same port: the very next request is served, and exactly
        c.store, _ = await start_store(c.settings, f"127.0.0.1:{c.store_port}")
        prompt = prompt_of(14, 6)
        assert tokens(await collect(c.stub, request(prompt, 10))) == reference(
            engines["deepseek_v3"], prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert c.metrics()["moetier_dense_worker_finished_requests_total{finish_reason=failed}"] == 2


class SlowStore(spb_grpc.ExpertStoreServicer):
    """Answers Info like the real store, then never answers ComputeExperts in time."""

    def __init__(self, info: spb.InfoResponse) -> None:
        self.info = info

    async def Info(self, request: spb.InfoRequest, context: grpc.aio.ServicerContext) -> spb.InfoResponse:
        return self.info

    async def ComputeExperts(self, request: spb.ComputeExpertsRequest,
                             context: grpc.aio.ServicerContext) -> spb.ComputeExpertsResponse:
        await asyncio.sleep(30)
        return spb.ComputeExpertsResponse()

    async def Prefetch(self, request: spb.PrefetchRequest, context: grpc.aio.ServicerContext) -> spb.PrefetchResponse:
        return spb.PrefetchResponse()


async def test_slow_store_fails_within_the_deadline(models: dict[str, Path], tmp_path: Path) -> None:
    from moetier.weights.container import Container

    with Container.open(models["qwen3_moe"]) as cont:
        info = spb.InfoResponse(model_id=cont.index.identity, hidden_size=cont.args.hidden_size)
    server = grpc.aio.server()
    spb_grpc.add_ExpertStoreServicer_to_server(SlowStore(info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with cluster(models["qwen3_moe"], tmp_path, store=False, store_address=f"127.0.0.1:{port}",
                           inference={"expert_timeout_s": 0.5}) as c:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.stub, request([5, 6, 7], 3))
            assert e.value.code() == UNAVAILABLE
            assert "ComputeExperts" in (e.value.details() or "")
            assert time.monotonic() - t0 < 2.0
    finally:
        await server.stop(0)


async def test_store_of_another_model_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    settings = settings_for(models["deepseek_v3"], tmp_path)
    other, port = await start_store(settings)
    try:
        async with cluster(models["qwen3_moe"], tmp_path, store=False, store_address=f"127.0.0.1:{port}") as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.stub, request([5, 6, 7], 3))
            assert e.value.code() == UNAVAILABLE and "serves model" in (e.value.details() or "")
    finally:
        await other.stop(0)


# ---- prefix cache ------------------------------------------------------------------------------
async def conversation(c: Cluster, turn1: list[int], extra: list[int]) -> tuple[list[int], list[int], int, int]:
    """Two greedy turns; the second prompt extends the first prompt and its answer."""
    out1 = tokens(await collect(c.stub, request(turn1, 20, rid="t1")))
    msgs = await collect(c.stub, request(turn1 + out1 + extra, 20, rid="t2"))
    return out1, tokens(msgs), msgs[0].cached_prompt_tokens, msgs[0].prompt_tokens


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
async def test_conversation_resumes_after_a_worker_restart(arch: str, models: dict[str, Path],
                                                           engines: dict[str, Engine], tmp_path: Path) -> None:
    """qwen3_next: the Gated DeltaNet state saved at the first turn's end is what the second resumes."""
    turn1, extra = prompt_of(45, 20), prompt_of(7, 21)
    async with cluster(models[arch], tmp_path / "a") as c:
        out1, out2, cached, total = await conversation(c, turn1, extra)
    assert cached == len(turn1) + len(out1) - 1  # all of the first turn's KV (its last token was never fed)
    assert out2 == reference(engines[arch], turn1 + out1 + extra,
                             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))

    async with cluster(models[arch], tmp_path / "b") as c:
        first = tokens(await collect(c.stub, request(turn1, 20, rid="t1")))
        assert first == out1
        await wait_for(lambda: _files(tmp_path / "b" / "prefix", 1), 5, "the prefix to reach the disk")
        store = c.store
        c.store = None
        await c.worker.stop(0)  # the worker goes away; the store stays
        worker, wport = create_worker(c.settings, "127.0.0.1:0")
        await worker.start()
        c.worker = worker
        await c.channel.close()
        c.channel = grpc.aio.insecure_channel(f"127.0.0.1:{wport}")
        c.stub = dense_worker_pb2_grpc.DenseWorkerStub(c.channel)
        c.store = store
        msgs = await collect(c.stub, request(turn1 + out1 + extra, 20, rid="t2"))
        assert msgs[0].cached_prompt_tokens == cached and msgs[0].prompt_tokens == total
        assert tokens(msgs) == out2
        m = c.metrics()
        assert m["moetier_dense_worker_prefix_cache_hit_tokens_total"] == cached
        assert m["moetier_dense_worker_prefix_cache_query_tokens_total"] == total


@pytest.mark.parametrize("arch", ARCHS)
async def test_reuse_to_the_token_in_a_batch(arch: str, models: dict[str, Path], engines: dict[str, Engine],
                                             tmp_path: Path) -> None:
    """After one request, a batch of prompts reusing its KV to the token (strict prefixes of 17, 30,
    31 and 33 tokens, the conversation's next turn, the same prompt again) and one sharing
    nothing: each reuses all it shares but its last token, and equals the engine's output without
    any reuse."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = prompt_of(40, 60)
    async with cluster(models[arch], tmp_path) as c:
        out = tokens(await collect(c.stub, request(base, 8, rid="first")))
        held = len(base) + len(out) - 1  # the last generated token was never fed
        # a fixed-size state resumes only where it was saved: the prompt less one token, the end
        hybrid = any(c.worker.core.model.args.linear_layers)
        cases = [(base[:17], 0 if hybrid else 16), (base[:30], 0 if hybrid else 29), (base[:31], 0 if hybrid else 30),
                 (base[:33], 0 if hybrid else 32), (base, 39), ([*base, *out, *prompt_of(5, 61)], held),
                 (prompt_of(30, 62), 0)]
        got = await asyncio.gather(*(collect(c.stub, request(p, 8, rid=f"b{i}")) for i, (p, _) in enumerate(cases)))
        for (prompt, cached), msgs in zip(cases, got, strict=True):
            assert msgs[0].cached_prompt_tokens == cached, len(prompt)
            assert tokens(msgs) == reference(engines[arch], prompt, greedy), len(prompt)
        m = c.metrics()
        assert m["moetier_dense_worker_prefix_cache_hit_tokens_total"] == sum(n for _, n in cases)


async def _files(d: Path, n: int) -> bool:
    return len(list(d.glob("*.kv"))) >= n


async def test_corrupt_or_torn_cache_files_are_ignored(models: dict[str, Path], engines: dict[str, Engine],
                                                       tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    a, b = prompt_of(40, 30), prompt_of(40, 31)
    async with cluster(models["qwen3_moe"], tmp_path) as c:
        out_a = tokens(await collect(c.stub, request(a, 8, rid="a")))
        out_b = tokens(await collect(c.stub, request(b, 8, rid="b")))
        await wait_for(lambda: _files(prefix, 2), 5, "two cache files")
    f_a, f_b = (cache_file(prefix, x + y[:-1], _mid(models)) for x, y in ((a, out_a), (b, out_b)))
    assert f_a.is_file() and f_b.is_file()
    raw = bytearray(f_a.read_bytes())
    raw[-100] ^= 0x55  # a flipped bit in the KV payload: found by the checksum when read
    f_a.write_bytes(bytes(raw))
    f_b.write_bytes(f_b.read_bytes()[:-64])  # torn: found by the size when the worker starts
    (prefix / "garbage.kv").write_bytes(b"not a cache file")
    async with cluster(models["qwen3_moe"], tmp_path) as c:
        for prompt, out in ((a, out_a), (b, out_b)):
            msgs = await collect(c.stub, request(prompt + out + [9, 10], 6))
            assert msgs[0].cached_prompt_tokens == 0  # never trusted
            assert tokens(msgs) == reference(engines["qwen3_moe"], prompt + out + [9, 10],
                                             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        m = c.metrics()
        assert m["moetier_dense_worker_prefix_cache_rejected_files_total"] == 3
    assert not f_b.exists() and not (prefix / "garbage.kv").exists()


def cache_file(prefix: Path, held: list[int], model_id: str) -> Path:
    """The file of the entry holding the tokens `held`."""
    return prefix / f"{entry_key(np.asarray(held), block_hashes(held, 16, model_id), model_id):016x}.kv"


def _mid(models: dict[str, Path]) -> str:
    from moetier.weights.container import Container

    with Container.open(models["qwen3_moe"]) as cont:
        return cont.index.identity


# ---- router membership -------------------------------------------------------------------------
async def test_registers_with_the_router_and_reports_prefixes(models: dict[str, Path], tmp_path: Path) -> None:
    from moetier.rpc.v1 import router_pb2, router_pb2_grpc
    from services.router.server import create_server as create_router

    settings = settings_for(models["qwen3_moe"], tmp_path)
    router, rport = create_router(settings, "127.0.0.1:0")
    await router.start()
    try:
        rset = {"router": {"bind": "127.0.0.1:0", "address": f"127.0.0.1:{rport}", "metrics_port": 0, "id": "router"}}
        async with cluster(models["qwen3_moe"], tmp_path, register=True, **rset) as c, \
                grpc.aio.insecure_channel(f"127.0.0.1:{rport}") as rch:
            rstub = router_pb2_grpc.RouterStub(rch)

            async def registered() -> bool:
                status = await rstub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)
                return any(m.member_id == "worker-t" and m.HasField("load") for m in status.members)

            await wait_for(registered, 5, "the worker to register")
            status = await rstub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)
            member = next(m for m in status.members if m.member_id == "worker-t")
            assert member.model_id == c.worker.core.model_id and member.load.max_batch == 8
            prompt = prompt_of(40, 40)
            via_router = [t.token_id async for m in rstub.Generate(request(prompt, 10), timeout=30) for t in m.tokens]
            direct = tokens(await collect(c.stub, request(prompt, 10)))
            assert via_router == direct
            load = await c.load()
            assert load.prefix_block == 16
            held = prompt + direct[:-1]
            expect = block_hashes(held, 16, c.worker.core.model_id)
            assert set(expect) <= set(load.prefix_hashes) and len(expect) == 3
    finally:
        await router.stop(0)


async def test_a_slot_the_router_hands_on_after_a_cancel_is_admitted(models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """Through the real router, one batch slot and no queue on the worker: a caller hangs up while
    the worker's step is held (no boundary), the router gives its slot to the next request at once,
    and the worker admits that request instead of refusing it (which the gateway would turn into a
    429 although the router had room)."""
    from moetier.rpc.v1 import router_pb2, router_pb2_grpc
    from services.router.server import create_server as create_router

    router, rport = create_router(settings_for(models["qwen3_moe"], tmp_path), "127.0.0.1:0")
    await router.start()
    try:
        rset = {"bind": "127.0.0.1:0", "address": f"127.0.0.1:{rport}", "metrics_port": 0, "id": "router"}
        async with cluster(models["qwen3_moe"], tmp_path, register=True, router=rset,
                           inference={"max_batch_size": 1, "max_waiting": 0}) as c, \
                grpc.aio.insecure_channel(f"127.0.0.1:{rport}") as rch:
            rstub = router_pb2_grpc.RouterStub(rch)

            async def registered() -> bool:
                status = await rstub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)
                return any(m.member_id == "worker-t" and m.HasField("load") for m in status.members)

            async def queued() -> bool:
                return (await rstub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5)).queued == 1

            await wait_for(registered, 5, "the worker to register")
            for i in range(3):
                a = rstub.Generate(request([5, 6, 7], 1000, rid=f"a{i}"), timeout=30)
                await a.read()  # a holds the worker's only slot
                async with step_held(c):
                    b = rstub.Generate(request([5, 6, 8], 2, rid=f"b{i}"), timeout=30)
                    await wait_for(queued, 5, "b to wait in the router's queue for a's slot")
                    a.cancel()
                    first = asyncio.ensure_future(b.read())
                    await wait_for(lambda: _waiting(c, 1), 5, "b to reach the worker and wait there")
                msgs = [await first]
                while msgs[-1] is not grpc.aio.EOF:
                    msgs.append(await b.read())
                assert len(tokens(msgs[:-1])) == 2
            assert c.metrics()["moetier_dense_worker_rejected_requests_total{reason=queue_full}"] == 0
    finally:
        await router.stop(0)


async def test_serves_direct_calls_while_the_router_is_down(models: dict[str, Path], tmp_path: Path) -> None:
    rset = {"router": {"bind": "127.0.0.1:0", "address": "127.0.0.1:1", "metrics_port": 0, "id": "router"}}
    async with cluster(models["qwen3_moe"], tmp_path, register=True, **rset) as c:
        assert len(tokens(await collect(c.stub, request([5, 6, 7], 4)))) == 4
        assert c.worker.agent is not None and not c.worker.agent.registered.is_set()


# ---- metrics -----------------------------------------------------------------------------------
async def test_metrics_are_documented_and_exported(models: dict[str, Path], tmp_path: Path) -> None:
    documented = set()
    for line in (metrics_module.__doc__ or "").splitlines():
        if line.startswith("| moetier_"):
            documented.add(line.split("|")[1].strip())
    async with cluster(models["deepseek_v3"], tmp_path) as c:
        await collect(c.stub, request(prompt_of(30, 50), 10))
        m = c.metrics()
        exported = {f.name + ("_total" if f.type == "counter" else "")
                    for f in c.worker.core.metrics.registry.collect()}
        assert exported == documented, (sorted(exported - documented), sorted(documented - exported))
        for name in documented:
            assert name.startswith("moetier_dense_worker_")
            assert name.rsplit("_", 2)[-1] in ("seconds", "bytes", "total", "requests", "rows", "sequences",
                                               "entries") or name.endswith("_total"), name
        assert m["moetier_dense_worker_prefetch_actual_experts_total"] > 0
        assert 0 < m["moetier_dense_worker_prefetch_hit_experts_total"] <= m["moetier_dense_worker_prefetch_actual_experts_total"]
        assert m["moetier_dense_worker_prefetch_hints_total{outcome=sent}"] > 0
        for phase in ("attention", "gate", "expert", "sampling", "other"):
            assert m[f"moetier_dense_worker_step_phase_seconds_count{{phase={phase}}}"] == m["moetier_dense_worker_steps_total"]
        assert m["moetier_dense_worker_step_phase_seconds_sum{phase=expert}"] > 0
        assert m["moetier_dense_worker_time_to_first_token_seconds_count"] == 1
        assert m["moetier_dense_worker_inter_token_latency_seconds_count"] == 9
        assert m["moetier_dense_worker_prompt_tokens_total"] == 30
        assert m["moetier_dense_worker_store_expert_hits_total"] + m["moetier_dense_worker_store_expert_misses_total"] > 0
