"""The one client: OpenAI `/v1/completions`, streamed, timed the same way for every system.

Per request: TTFT (request sent -> first token's chunk), decode tok/s ((tokens - 1) /
(last token's chunk - first token's chunk)), the text, and, through the hooks, the system's
CPU time and disk bytes between the first and the last token (decode) and over the whole
request. Decode counts one token per streamed step chunk, for every system: both servers
stream a chunk per generated step, with empty text while a multi-byte character or a
partial stop match is held back (a model with random weights gives many such tokens). A
last chunk with no text that only carries the finish_reason is not a step. Where the server
reports usage (moetier: stream_options.include_usage) and it counts more tokens than steps
(several tokens per step, as speculative decoding gives), the usage count is used.
A completion whose one token decodes to no text and comes only with the finish (a 1-token
prefill request) is timed by that finishing chunk: the server sends it as soon as the
token is made.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from moetier.errors import Unavailable


@dataclass
class Counters:
    """What the system had spent at one moment (from its Sandbox)."""

    t: float
    cpu_s: float
    read_bytes: int


@dataclass
class Timed:
    prompt_chars: int
    max_tokens: int
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens: int = 0  # generated tokens timed: step chunks, or the usage count where it is larger
    usage_tokens: int | None = None  # completion_tokens as the server reported them
    text: str = ""
    finish_reason: str | None = None
    decode_cpu_s: float = 0.0
    decode_wall_s: float = 0.0
    read_bytes: int = 0  # over the whole request
    chunks: list[float] = field(default_factory=list, repr=False)  # arrival of each step chunk

    @property
    def decode_tok_s(self) -> float | None:
        if self.tokens < 2 or self.decode_wall_s <= 0:
            return None
        return (self.tokens - 1) / self.decode_wall_s

    @property
    def cores_busy(self) -> float | None:
        return self.decode_cpu_s / self.decode_wall_s if self.decode_wall_s > 0 else None


def complete(url: str, model: str, prompt: str, max_tokens: int, counters: Callable[[bool], Counters],
             *, usage: bool, timeout_s: float = 3600.0) -> Timed:
    """One greedy streamed completion; `counters(disk)` is read at the start and the end, and at
    every step chunk without the disk bytes (`disk` False: 0), which are only needed over the
    whole request -- reading them there cost the system CPU time per token, and more for a
    system of more processes."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    out = Timed(len(prompt), max_tokens)
    pieces: list[str] = []
    first: Counters | None = None
    last: Counters | None = None
    finished: Counters | None = None  # the chunk with the finish_reason
    usage_tokens: int | None = None
    start = counters(True)
    with httpx.Client(timeout=timeout_s) as client, client.stream("POST", f"{url}/v1/completions",
                                                                   json=body) as r:
        if r.status_code != 200:
            r.read()
            raise Unavailable(f"{url}/v1/completions answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or ""
                finish = choice.get("finish_reason")
                if text or not finish:  # a step (a finish-only chunk is not)
                    now = counters(False)
                    if first is None:
                        first = now
                    last = now
                    out.chunks.append(now.t)
                    pieces.append(text)
                if finish:
                    out.finish_reason = finish
                    if first is None and finished is None:
                        finished = counters(False)
    end = counters(True)
    if first is None and finished is not None:  # a token without text: timed by its finish
        first = last = finished
        out.chunks.append(finished.t)
    if first is None or last is None:
        raise Unavailable(f"{url}: the completion streamed no token (finish_reason {out.finish_reason})")
    out.text = "".join(pieces)
    out.tokens = max(len(out.chunks), usage_tokens or 0)
    out.usage_tokens = usage_tokens
    out.ttft_s = first.t - start.t
    out.total_s = end.t - start.t
    out.decode_wall_s = last.t - first.t
    out.decode_cpu_s = last.cpu_s - first.cpu_s
    out.read_bytes = end.read_bytes - start.read_bytes
    return out


def wait_ready(url: str, alive: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll GET {url}/v1/models until it answers 200; Unavailable if `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise Unavailable(f"{what} exited during start-up")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise Unavailable(f"{what} did not answer {url}/v1/models within {timeout_s:.0f} s")
