"""Generation as a chain of small functions over `Model.step`, for one sequence.

Legend: T = prompt tokens, V = vocab.

    prefill(model, cache, prompt)      -> logits [V] of the last prompt token
    decode_one_token(model, cache, t)  -> logits [V] after appending t
    generate(model, prompt, params)    -> yields GeneratedToken until stop / length
    teacher_forced_logits(model, ids)  -> [T, V]: logits at every position, one pass

The serving engine batches many sequences per `Model.step` itself; these are the
single-sequence path (CLI, tests, oracle comparisons).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from moetier.model.forward import Model
from moetier.model.kv_cache import KVCache
from moetier.model.sampling import Sampler, SamplingParams

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class GeneratedToken:
    token: int
    finish_reason: str | None = None  # "stop" | "length" on the last token
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def prefill(model: Model, cache: KVCache, prompt: Sequence[int] | npt.NDArray[np.integer],
            chunk_size: int | None = None) -> F32:
    """Append the prompt to the cache, `chunk_size` tokens per step (None: one step); logits [V]."""
    ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
    if len(ids) == 0:
        raise ValueError("empty prompt")
    step = chunk_size or len(ids)
    logits: F32 | None = None
    for i in range(0, len(ids), step):
        logits = model.step([(cache, ids[i : i + step])])[0]
    assert logits is not None
    return logits


def decode_one_token(model: Model, cache: KVCache, token: int) -> F32:
    return model.step([(cache, [token])])[0]


def generate(model: Model, prompt: Sequence[int] | npt.NDArray[np.integer], params: SamplingParams,
             cache: KVCache | None = None, chunk_size: int | None = None) -> Iterator[GeneratedToken]:
    """Yield generated tokens; the last one carries its finish_reason. `cache`, when given,
    holds this sequence's earlier tokens (a reused prefix) and is extended in place."""
    if params.max_tokens == 0:
        return
    cache = cache if cache is not None else model.new_cache()
    cache.expect(max(cache.expected, cache.length + len(prompt) + params.max_tokens))  # the most it may reach
    sampler = Sampler(params, model.args.vocab_size, model.args.eos_token_ids)
    logits = prefill(model, cache, prompt, chunk_size)
    while True:
        s = sampler.choose(logits)
        reason = sampler.finish_reason(s.token)
        yield GeneratedToken(s.token, reason, s.logprob, s.top_logprobs)
        if reason is not None:
            return
        logits = decode_one_token(model, cache, s.token)


def teacher_forced_logits(model: Model, ids: Sequence[int] | npt.NDArray[np.integer]) -> F32:
    """Logits [T, V] at every position of `ids`, in one step on a fresh cache."""
    return model.step([(model.new_cache(), ids)], all_logits=True)[0]
