"""`moetier ab`: the same prompts to two OpenAI-compatible endpoints (moetier and another
moetier, or a cloud API), side by side, for several rounds so that cache warming shows.

    moetier ab --a http://127.0.0.1:8000/v1 --a-model demo \\
               --b https://api.example.com/v1 --b-model some-model --b-key-env EXAMPLE_API_KEY
    moetier ab --config ab.yaml [--json]

Per prompt, round and endpoint it prints TTFT (request sent -> first text), total time,
characters/s and tokens/s of the answer (tokens from the stream's usage, where the endpoint
reports it), and, where both answers are JSON, a field-by-field diff of the two. Requests are
streamed chat completions, one at a time (the endpoints never compete). Keys are read from
the environment variables named (never given on the command line). The YAML:

    endpoints:
      - {name: local, base_url: "http://127.0.0.1:8000/v1", model: demo, api_key_env: MOETIER_API_KEY}
      - {name: cloud, base_url: "https://...", model: ..., api_key_env: CLOUD_API_KEY}
    prompts: ["...", "..."]          # or --prompts FILE: one per line, or a YAML/JSON list
    rounds: 3
    max_tokens: 64
    temperature: 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

BUILTIN_PROMPTS = [
    "Explain in two sentences why a mixture-of-experts model can run with most of its weights on disk.",
    'Answer with JSON only: {"disk": <a disk type>, "bandwidth_gb_s": <a number>, "mirrored": <true or false>}',
    "List three things that make the first token of a long prompt slow.",
]


class ABError(Exception):
    """A problem to show as one line."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    base_url: str
    model: str
    api_key_env: str | None = None

    def headers(self) -> dict[str, str]:
        if not self.api_key_env:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ABError(f"endpoint {self.name}: the environment variable {self.api_key_env} is not set")
        return {"Authorization": f"Bearer {key}"}


@dataclass
class Run:
    endpoint: str
    prompt: int
    round: int
    ttft_s: float | None
    total_s: float
    chars: int
    tokens: int | None
    text: str
    error: str | None = None

    @property
    def chars_per_s(self) -> float:
        return self.chars / self.total_s if self.total_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.total_s if self.tokens is not None and self.total_s > 0 else None


def ask(client: httpx.Client, ep: Endpoint, prompt: str, max_tokens: int, temperature: float) -> Run:
    body = {"model": ep.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    tokens: int | None = None
    with client.stream("POST", ep.base_url.rstrip("/") + "/chat/completions", json=body,
                       headers=ep.headers()) as r:
        if r.status_code != 200:
            r.read()
            raise ABError(f"endpoint {ep.name}: {r.status_code} {r.text.strip()[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise ABError(f"endpoint {ep.name} failed mid-answer: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(piece)
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
    text = "".join(parts)
    return Run(ep.name, 0, 0, ttft, time.perf_counter() - start, len(text), tokens, text)


def _json(text: str) -> Any:
    t = text.strip()
    if t.startswith("```"):
        t = t.strip("`").removeprefix("json").strip()
    try:
        return json.loads(t)
    except ValueError:
        return None


def _flat(v: Any, path: str = "$") -> dict[str, Any]:
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k, x in v.items():
            out.update(_flat(x, f"{path}.{k}"))
        return out or {path: {}}
    if isinstance(v, list):
        out = {}
        for i, x in enumerate(v):
            out.update(_flat(x, f"{path}[{i}]"))
        return out or {path: []}
    return {path: v}


def json_diff(a: str, b: str) -> list[dict[str, Any]] | None:
    """Field-by-field differences of two JSON answers (None unless both are JSON)."""
    va, vb = _json(a), _json(b)
    if va is None or vb is None:
        return None
    fa, fb = _flat(va), _flat(vb)
    missing = object()
    out = []
    for path in sorted(set(fa) | set(fb)):
        x, y = fa.get(path, missing), fb.get(path, missing)
        if x != y:
            out.append({"path": path, "a": None if x is missing else x, "b": None if y is missing else y,
                        "only": "b" if x is missing else "a" if y is missing else None})
    return out


def run_ab(endpoints: list[Endpoint], prompts: list[str], rounds: int, max_tokens: int, temperature: float,
           timeout_s: float = 600.0) -> dict[str, Any]:
    runs: list[Run] = []
    diffs = []
    with httpx.Client(timeout=timeout_s) as client:
        for rnd in range(1, rounds + 1):
            for i, prompt in enumerate(prompts):
                pair = []
                for ep in endpoints:
                    try:
                        r = ask(client, ep, prompt, max_tokens, temperature)
                    except httpx.TransportError as e:
                        raise ABError(f"endpoint {ep.name}: cannot reach {ep.base_url} ({e})") from None
                    r.prompt, r.round = i, rnd
                    runs.append(r)
                    pair.append(r)
                if len(pair) == 2:
                    d = json_diff(pair[0].text, pair[1].text)
                    if d is not None:
                        diffs.append({"prompt": i, "round": rnd, "differences": d})
    return {"endpoints": [asdict(e) for e in endpoints], "prompts": prompts,
            "runs": [{**asdict(r), "chars_per_s": r.chars_per_s, "tokens_per_s": r.tokens_per_s} for r in runs],
            "json_diffs": diffs}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(result: dict[str, Any]) -> str:
    rows = [("prompt", "round", "endpoint", "TTFT s", "total s", "chars/s", "tokens/s", "tokens")]
    for r in result["runs"]:
        rows.append((str(r["prompt"] + 1), str(r["round"]), r["endpoint"], _f(r["ttft_s"], ".3f"),
                     _f(r["total_s"], ".3f"), _f(r["chars_per_s"], ".1f"), _f(r["tokens_per_s"], ".1f"),
                     "-" if r["tokens"] is None else str(r["tokens"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c != 2 else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths,
                                                                                                     strict=True)))
             for row in rows]
    names = [e["name"] for e in result["endpoints"]]
    for d in result["json_diffs"]:
        head = f"prompt {d['prompt'] + 1}, round {d['round']}: JSON "
        if not d["differences"]:
            lines.append(head + "equal")
            continue
        lines.append(head + f"differs ({names[0]} | {names[-1]}):")
        for x in d["differences"]:
            lines.append(f"  {x['path']}: {json.dumps(x['a'])} | {json.dumps(x['b'])}"
                         + (f"  (only in {names[0] if x['only'] == 'a' else names[-1]})" if x["only"] else ""))
    return "\n".join(lines)


def _prompts_file(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml", ".json"):
        data = yaml.safe_load(text)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ABError(f"{path}: expected a list of prompt strings")
        return data
    return [line for line in (x.strip() for x in text.splitlines()) if line]


def _from_args(args: argparse.Namespace) -> tuple[list[Endpoint], list[str], int, int, float]:
    cfg: dict[str, Any] = {}
    if args.config is not None:
        loaded = yaml.safe_load(args.config.read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise ABError(f"{args.config}: expected a mapping (endpoints, prompts, rounds, max_tokens)")
        cfg = loaded
    endpoints = []
    for i, e in enumerate(cfg.get("endpoints") or []):
        try:
            endpoints.append(Endpoint(str(e.get("name") or f"e{i + 1}"), str(e["base_url"]), str(e["model"]),
                                      e.get("api_key_env")))
        except (KeyError, AttributeError):
            raise ABError(f"{args.config}: endpoints[{i}] needs base_url and model") from None
    for side in ("a", "b"):
        url = getattr(args, side)
        if url:
            model = getattr(args, f"{side}_model")
            if not model:
                raise ABError(f"--{side} needs --{side}-model")
            endpoints.append(Endpoint(getattr(args, f"{side}_name") or side, url, model, getattr(args, f"{side}_key_env")))
    if len(endpoints) != 2:
        raise ABError(f"give exactly two endpoints (--a/--b or the config's endpoints); got {len(endpoints)}")
    prompts = _prompts_file(args.prompts) if args.prompts else list(cfg.get("prompts") or BUILTIN_PROMPTS)
    rounds = args.rounds if args.rounds is not None else int(cfg.get("rounds", 3))
    max_tokens = args.max_tokens if args.max_tokens is not None else int(cfg.get("max_tokens", 64))
    temperature = args.temperature if args.temperature is not None else float(cfg.get("temperature", 0.0))
    if rounds < 1 or max_tokens < 1 or not prompts:
        raise ABError("rounds and max_tokens must be >= 1, and there must be prompts")
    return endpoints, prompts, rounds, max_tokens, temperature


def run(args: argparse.Namespace) -> int:
    try:
        endpoints, prompts, rounds, max_tokens, temperature = _from_args(args)
        result = run_ab(endpoints, prompts, rounds, max_tokens, temperature)
    except (ABError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else table(result))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("ab", help="send the same prompts to two OpenAI-compatible endpoints and compare "
                       "TTFT, speed and JSON answers over several rounds")
    for side in ("a", "b"):
        p.add_argument(f"--{side}", metavar="URL", help=f"endpoint {side.upper()}'s base URL (…/v1)")
        p.add_argument(f"--{side}-model", metavar="ID", help=f"endpoint {side.upper()}'s model id")
        p.add_argument(f"--{side}-key-env", metavar="VAR", help=f"environment variable holding {side.upper()}'s key")
        p.add_argument(f"--{side}-name", metavar="NAME", help=f"label of endpoint {side.upper()} (default {side})")
    p.add_argument("--config", type=Path, help="YAML with endpoints, prompts, rounds, max_tokens, temperature")
    p.add_argument("--prompts", type=Path, help="prompts file: one per line, or a YAML/JSON list")
    p.add_argument("--rounds", type=int, help="rounds over all prompts (default 3)")
    p.add_argument("--max-tokens", type=int, help="max_tokens per answer (default 64)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.set_defaults(func=run)
