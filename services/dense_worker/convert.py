"""Protobuf <-> dense worker domain types: the one place where the two meet, and where a
request is checked (every problem is an InvalidArgument naming the field)."""

from __future__ import annotations

import math

import numpy as np

from moetier.errors import InvalidArgument
from moetier.model.sampling import SamplingParams
from moetier.rpc.v1 import dense_worker_pb2, generate_pb2
from services.dense_worker.batcher import Limits, Output, Request
from services.dense_worker.core import LoadSnapshot

MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"sampling.{name} must be a finite number, got {value}")
    return value


def sampling_from_pb(p: generate_pb2.SamplingParams, limits: Limits, prompt_tokens: int) -> SamplingParams:
    temperature = _finite("temperature", p.temperature)
    if temperature < 0:
        raise InvalidArgument(f"sampling.temperature must be >= 0 (0: greedy), got {temperature}")
    top_p = _finite("top_p", p.top_p) or 1.0  # 0 is the unset proto3 default: off
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _finite(name, getattr(p, name))
        if abs(v) > MAX_PENALTY:
            raise InvalidArgument(f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}")
    if p.max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens must be >= 1")
    if prompt_tokens + p.max_tokens > limits.max_seq_len:
        raise InvalidArgument(f"{prompt_tokens} prompt tokens + max_tokens {p.max_tokens} exceed this worker's "
                              f"{limits.max_seq_len} positions per sequence")
    if p.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    bad = [t for t in p.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidArgument(f"sampling.stop_token_ids: {bad[0]} is not below the vocab size {limits.vocab_size}")
    return SamplingParams(temperature=temperature, top_k=p.top_k, top_p=top_p,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          max_tokens=p.max_tokens, stop_token_ids=tuple(p.stop_token_ids), ignore_eos=True,
                          seed=p.seed if p.HasField("seed") else None, logprobs=p.logprobs,
                          top_logprobs=p.top_logprobs)


def request_from_pb(req: generate_pb2.GenerateRequest, limits: Limits) -> Request:
    where = f"request {req.request_id!r}" if req.request_id else "request"
    if not req.prompt_ids:
        raise InvalidArgument(f"{where}: prompt_ids is empty")
    prompt = np.asarray(req.prompt_ids, dtype=np.int64)
    if int(prompt.max()) >= limits.vocab_size:
        i = int(np.argmax(prompt >= limits.vocab_size))
        raise InvalidArgument(f"{where}: prompt_ids[{i}] = {int(prompt[i])} is not below the vocab size "
                              f"{limits.vocab_size}")
    try:
        params = sampling_from_pb(req.sampling, limits, len(prompt))
    except InvalidArgument as e:
        raise InvalidArgument(f"{where}: {e}") from None
    grammar = req.sampling.grammar if req.sampling.HasField("grammar") else None
    if grammar is not None and not grammar.strip():
        raise InvalidArgument(f"{where}: sampling.grammar is empty")
    return Request(request_id=req.request_id, prompt=prompt, params=params, grammar=grammar)


def response_to_pb(out: Output, worker_id: str) -> generate_pb2.GenerateResponse:
    tok = out.token
    gen = generate_pb2.GeneratedToken(token_id=tok.token)
    if tok.logprob is not None:
        gen.logprob = tok.logprob
        gen.top_logprobs.extend(generate_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in tok.top_logprobs)
    t = out.timings
    msg = generate_pb2.GenerateResponse(
        tokens=[gen],
        timings=generate_pb2.StepTimings(step_ns=int(t.step_s * 1e9), attention_ns=int(t.attention_s * 1e9),
                                         gate_ns=int(t.gate_s * 1e9), expert_ns=int(t.expert_s * 1e9),
                                         sampling_ns=int(t.sampling_s * 1e9), batch_rows=t.rows,
                                         mask_ns=int(t.mask_s * 1e9)))
    if out.finish_reason is not None:
        msg.finish_reason = out.finish_reason
    if out.first:
        msg.prompt_tokens = out.prompt_tokens
        msg.cached_prompt_tokens = out.cached_tokens
        msg.worker_id = worker_id
        msg.queue_ns = int(out.queue_s * 1e9)
    return msg


def load_to_pb(load: LoadSnapshot) -> dense_worker_pb2.WorkerLoad:
    return dense_worker_pb2.WorkerLoad(running=load.running, waiting=load.waiting, kv_bytes=load.kv_bytes,
                                       max_batch=load.max_batch, max_waiting=load.max_waiting,
                                       prefix_hashes=load.prefix_hashes, prefix_block=load.prefix_block)
