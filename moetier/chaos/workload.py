"""The harness's fixed workload, and the check of every request's outcome.

A workload is a list of `Spec`s, made from their index alone (so every run, the reference
included, sends the same requests): chat and legacy completions, streamed and not, short and
long prompts, 4 to 48 tokens, greedy (temperature 0, checked token for token against the
reference run) or sampled with a seed and top_p.

`run_one` sends a request and classifies what came back (`Outcome.kind`):
- ok: 200 with a well-formed body, or a stream of well-formed chunks ending in a finish reason and
  [DONE];
- clean: a refusal the fault allows (`allowed`: HTTP statuses, "transport" for a refused or reset
  connection), with the OpenAI error envelope; mid-stream, an error event in the envelope (its
  code naming an allowed status);
- wrong: anything else (another status, no envelope, a stream cut without an error event);
- hung: no answer within the request deadline.
`tokens_wrong` marks a greedy request whose text (the part received, for a stream cut by a
fault) is not the reference's (a prefix of it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "demo"
CODE_STATUS = {"service_unavailable": 503, "internal_error": 500, "rate_limit_exceeded": 429,
               "invalid_value": 400, "not_found": 404}
WORDS = ("expert", "disk", "mirror", "cache", "router", "token", "layer", "stream", "queue", "record")


@dataclass(frozen=True)
class Spec:
    index: int
    kind: str  # "chat" | "completion"
    stream: bool
    max_tokens: int
    temperature: float
    seed: int | None
    top_p: float
    prompt: str

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": self.temperature,
                             "stream": self.stream}
        if self.seed is not None:
            b["seed"] = self.seed
        if self.top_p != 1.0:
            b["top_p"] = self.top_p
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        return b

    @property
    def key(self) -> str:
        """What decides a greedy request's text (streamed or not, the same)."""
        return json.dumps({k: v for k, v in self.body().items() if k != "stream"}, sort_keys=True)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def spec(i: int) -> Spec:
    """Request i of every workload."""
    n_words = (3, 12, 60)[(i // 2) % 3]
    words = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_words))
    greedy = i % 3 != 2
    return Spec(index=i, kind="completion" if i % 4 == 3 else "chat", stream=i % 2 == 0,
                max_tokens=(4, 16, 48)[(i // 3) % 3], temperature=0.0 if greedy else 0.8,
                seed=None if greedy else 1000 + i, top_p=1.0 if greedy else 0.9,
                prompt=f"Request {i % 8}: tell me about the {words}.")


def workload(n: int, start: int = 0) -> list[Spec]:
    return [spec(i) for i in range(start, start + n)]


@dataclass
class Outcome:
    index: int
    kind: str  # ok | clean | wrong | hung
    status: int | None = None  # HTTP status, or the status an error event names
    text: str = ""
    why: str = ""  # what was wrong, for wrong and hung
    tokens_wrong: bool = False
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed content chunks
    seconds: float = 0.0


def _envelope(body: Any) -> dict[str, Any] | None:
    """The OpenAI error object of a body, if it is one."""
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict):
        err = body["error"]
        if isinstance(err.get("message"), str) and err["message"] and "type" in err and "code" in err:
            return err
    return None


def _piece(chunk: dict[str, Any], kind: str) -> tuple[str, str | None]:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise ValueError(f"chunk without choices: {str(chunk)[:200]}")
    if not choices:
        return "", None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if kind == "chat" else c.get("text")
    return text or "", c.get("finish_reason")


async def run_one(client: httpx.AsyncClient, s: Spec, allowed: frozenset[int | str],
                  deadline_s: float) -> Outcome:
    t0 = time.monotonic()
    out = Outcome(s.index, "wrong")
    try:
        async with asyncio.timeout(deadline_s):
            if s.stream:
                await _stream(client, s, allowed, out, t0)
            else:
                await _plain(client, s, allowed, out)
    except TimeoutError:
        out.kind, out.why = "hung", f"no answer within {deadline_s:.0f} s"
    except (httpx.TransportError, httpx.RemoteProtocolError) as e:
        if "transport" in allowed:
            out.kind, out.why = "clean", f"connection: {type(e).__name__}"
        else:
            out.kind, out.why = "wrong", f"connection failed: {type(e).__name__} {e}"
    out.seconds = time.monotonic() - t0
    return out


def _refusal(out: Outcome, status: int, body: Any, headers: httpx.Headers, allowed: frozenset[int | str]) -> None:
    out.status = status
    err = _envelope(body)
    if err is None:
        out.kind, out.why = "wrong", f"status {status} without the error envelope: {str(body)[:200]}"
    elif status not in allowed:
        out.kind, out.why = "wrong", f"status {status} ({err.get('code')}): {err['message'][:200]}"
    elif status == 429 and not (headers.get("retry-after") or "").isdigit():
        out.kind, out.why = "wrong", "429 without a Retry-After of whole seconds"
    else:
        out.kind, out.why = "clean", f"{status} {err.get('code')}"


async def _plain(client: httpx.AsyncClient, s: Spec, allowed: frozenset[int | str], out: Outcome) -> None:
    r = await client.post(s.path, json=s.body())
    try:
        body = r.json()
    except ValueError:
        body = r.text
    if r.status_code != 200:
        _refusal(out, r.status_code, body, r.headers, allowed)
        return
    out.status = 200
    try:
        choice = body["choices"][0]
        out.text = choice["message"]["content"] or "" if s.kind == "chat" else choice["text"]
        finish, usage = choice["finish_reason"], body["usage"]
        ok = finish in ("stop", "length") and 0 < usage["completion_tokens"] <= s.max_tokens
    except (KeyError, IndexError, TypeError) as e:
        out.kind, out.why = "wrong", f"malformed body ({e}): {str(body)[:200]}"
        return
    out.kind, out.why = ("ok", "") if ok else ("wrong", f"finish {finish!r}, usage {usage}")


async def _stream(client: httpx.AsyncClient, s: Spec, allowed: frozenset[int | str], out: Outcome,
                  t0: float) -> None:
    async with client.stream("POST", s.path, json=s.body()) as r:
        if r.status_code != 200:
            raw = await r.aread()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw[:200]
            _refusal(out, r.status_code, body, r.headers, allowed)
            return
        out.status = 200
        finish: str | None = None
        done = False
        last: float | None = None
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if (err := _envelope(chunk)) is not None:
                    status = CODE_STATUS.get(str(err.get("code")), 500)
                    out.status = status
                    ok = status in allowed
                    out.kind = "clean" if ok else "wrong"
                    out.why = f"error event {err.get('code')}: {err['message'][:200]}"
                    return
                text, f = _piece(chunk, s.kind)
                if text:
                    now = time.monotonic()
                    if last is None:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    out.text += text
                finish = f or finish
        except (httpx.TransportError, httpx.RemoteProtocolError) as e:
            if "transport" in allowed:
                out.kind, out.why = "clean", f"stream cut: {type(e).__name__}"
            else:
                out.kind, out.why = "wrong", f"stream cut without an error event: {type(e).__name__}"
            return
        except ValueError as e:
            out.kind, out.why = "wrong", f"malformed chunk: {e}"
            return
        if done and finish in ("stop", "length"):
            out.kind = "ok"
        elif "transport" in allowed:
            out.kind, out.why = "clean", "stream ended early (connection)"
        else:
            out.kind, out.why = "wrong", f"stream ended without {'[DONE]' if not done else 'a finish reason'}"


def check_tokens(specs: list[Spec], outcomes: list[Outcome], reference: dict[str, str]) -> None:
    """Mark greedy outcomes whose text is not the reference's (a prefix of it, when cut short)."""
    for s, o in zip(specs, outcomes, strict=True):
        if not s.greedy or s.key not in reference:
            continue
        want = reference[s.key]
        whole = o.kind == "ok"
        o.tokens_wrong = o.text != want if whole else bool(o.text) and not want.startswith(o.text)
