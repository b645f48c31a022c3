"""`moetier chat`: a terminal chat against a gateway (or any OpenAI-compatible server).

Streams the reply as it comes, keeps the conversation (multi-turn), `/reset` forgets it,
`/exit` or Ctrl-D quits, Ctrl-C stops a reply (closing the connection cancels the
generation). Problems are one clear line: server unreachable, or its error message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import httpx

HELP = "Type a message. /reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply."


class ChatError(Exception):
    """A problem to show the user as one line."""


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
        return f"{r.status_code}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text.strip()[:200] or r.reason_phrase}"


class ChatSession:
    def __init__(self, client: httpx.Client, model: str, system: str | None, out: TextIO,
                 params: dict[str, Any] | None = None) -> None:
        self.client = client
        self.model = model
        self.system = system
        self.out = out
        self.params = params or {}
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> str:
        """Send one user turn and stream the reply to `out`; the turn joins the history only
        when the reply completes."""
        body = {"model": self.model, "messages": [*self.history, {"role": "user", "content": text}],
                "stream": True, **self.params}
        reply: list[str] = []
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise ChatError(_error_message(r))
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ChatError(f"the server failed mid-reply: {chunk['error'].get('message')}")
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content") or ""
                        reply.append(piece)
                        self.out.write(piece)
                        self.out.flush()
        except httpx.TransportError as e:
            raise ChatError(f"cannot reach the server at {self.client.base_url} ({e})") from None
        finally:
            if reply:
                self.out.write("\n")
        answer = "".join(reply)
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer


def pick_model(client: httpx.Client) -> str:
    try:
        r = client.get("/v1/models")
    except httpx.TransportError as e:
        raise ChatError(f"cannot reach the server at {client.base_url} ({e})") from None
    if r.status_code != 200:
        raise ChatError(_error_message(r))
    data = r.json().get("data") or []
    if not data:
        raise ChatError("the server lists no model")
    return str(data[0]["id"])


def chat_loop(session: ChatSession, read: Callable[[str], str], err: TextIO) -> int:
    while True:
        try:
            text = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            session.out.write("\n")
            return 0
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            err.write("(conversation cleared)\n")
            continue
        if text.startswith("/"):
            err.write(f"unknown command {text.split()[0]}. {HELP}\n")
            continue
        try:
            session.ask(text)
        except ChatError as e:
            err.write(f"error: {e}\n")
        except KeyboardInterrupt:
            err.write("\n(reply stopped)\n")


def run(args: argparse.Namespace, read: Callable[[str], str] = input, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a request log line per turn would garble the chat
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    params: dict[str, Any] = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
                              if v is not None}
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers,
                      timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            model = args.model or pick_model(client)
        except ChatError as e:
            err.write(f"error: {e}\n")
            return 1
        err.write(f"chatting with {model} at {args.url}. {HELP}\n")
        return chat_loop(ChatSession(client, model, args.system, out, params), read, err)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("chat", help="chat with a model in the terminal (through a gateway)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway URL (default: %(default)s)")
    p.add_argument("--api-key", help="API key, if the gateway requires one")
    p.add_argument("--model", help="model id (default: the first one the gateway lists)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, help="limit each reply (default: the rest of the context)")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.set_defaults(func=run)
