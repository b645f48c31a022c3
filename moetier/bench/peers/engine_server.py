"""`bench peers --in-process`: moetier's in-process engine behind a minimal OpenAI endpoint.

    python -m moetier.bench.peers.engine_server --model DIR --expert-cache 100% --port N

The same client then times it as it times `moetier up` and llama_cpp.server, so the three
differ by what serves the tokens, not by how they are measured. One process, no service
hops: `moetier.engine.Engine` (resident dense part, the RAM tier -- read whole at start when it
holds every expert and storage.preload is on, as the expert store does -- FastOps on every CPU the
process may use), prompts prefilled in chunks of the settings' inference.prefill_chunk as
the dense worker does. It serves GET /v1/models, GET /health and streamed or plain POST
/v1/completions (string prompt, max_tokens, temperature 0 only: it is a benchmark's
endpoint, not a gateway), one request at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from moetier.engine import Engine
from moetier.model.sampling import SamplingParams
from moetier.settings import load_settings
from moetier.text import IncrementalDetokenizer
from moetier.wake_latency import hold_wake_latency


class _Handler(BaseHTTPRequestHandler):
    engine: Engine
    name: str
    chunk: int
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the benchmark prints
        pass

    def _json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.name, "object": "model"}]})
        elif self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        if not isinstance(body.get("prompt"), str) or float(body.get("temperature", 1.0)) != 0.0:
            self._json(400, {"error": {"message": "this endpoint takes a string prompt at temperature 0"}})
            return
        with self.lock:
            self._complete(body)

    def _complete(self, body: dict[str, Any]) -> None:
        e = self.engine
        tok = e.tokenizer
        ids = tok.encode(body["prompt"], add_special_tokens=True)
        params = SamplingParams(temperature=0.0, max_tokens=int(body.get("max_tokens", 16)),
                                stop_token_ids=e.eos_token_ids())
        stop = set(params.stop_token_ids)
        stream = bool(body.get("stream"))
        detok = IncrementalDetokenizer(tok.decode)
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
        texts, n, finish = [], 0, None
        for g in e.generate(ids, params, chunk_size=self.chunk):
            n += 1
            finish = g.finish_reason
            text = "" if g.token in stop else detok.add([g.token])
            if g.finish_reason is not None:
                text += detok.flush()
            texts.append(text)
            if stream:  # a chunk per step, then the finish alone, as llama.cpp's server streams
                self._event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
                if finish:
                    self._event({"choices": [{"index": 0, "text": "", "finish_reason": finish}]})
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        if stream:
            self._event({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        else:
            self._json(200, {"object": "text_completion", "model": self.name, "usage": usage,
                             "choices": [{"index": 0, "text": "".join(texts), "finish_reason": finish}]})

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--expert-cache", default="100%")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--activations", choices=["exact", "int8"], default="exact", help="the kernels' (int8: lossy)")
    p.add_argument("--config", type=Path)
    a = p.parse_args(argv)
    settings = load_settings(a.config)
    engine = Engine.open(a.model, budget=a.expert_cache, activations=a.activations)
    if settings.storage.preload:  # as the expert store does: a budget that holds every expert starts full
        engine.experts.tier.preload()
    handler = type("Handler", (_Handler,), {"engine": engine, "name": a.model.name,
                                             "chunk": settings.inference.prefill_chunk})
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler)
    print(f"serving {a.model} on http://127.0.0.1:{a.port}", flush=True)
    try:
        with hold_wake_latency(settings.kernels.max_wake_latency_us):  # as the dense worker and the store do
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
