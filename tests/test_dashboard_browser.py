"""The expert map page in headless Chromium, driven over the DevTools protocol: on a live
cluster with traffic it draws one cell per expert of every MoE layer and keeps changing
(screenshot saved to artifacts/dashboard.png); against a gateway whose stores do not
answer it says so."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers_gateway import make_model_dir, served
from helpers_observability import ROOT, build_model, eventually, local_cluster, traffic

from moetier.model.config import ModelArgs
from services.gateway.model import ServedModel

pytestmark = pytest.mark.timeout(300)

SCREENSHOT = ROOT / "artifacts" / "dashboard.png"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0", "--window-size=1400,1000", "--hide-scrollbars"]
# What the page shows, read in the page (the canvas carries the map's shape and counters).
STATE_JS = """(() => {
  const c = document.querySelector("canvas.map");
  const text = id => document.getElementById(id).textContent;
  return {status: document.body.dataset.status || null, heat: document.body.dataset.heat || null,
          banner: document.getElementById("banner").classList.contains("show") ? text("banner") : null,
          tps: text("tps"), ttft: text("ttft"), hit: text("hit"), header: text("status"),
          map: c && c.dataset.cells ? {layers: +c.dataset.layers, experts: +c.dataset.experts,
               cells: +c.dataset.cells, step: +c.dataset.step, frames: +c.dataset.frames,
               image: c.toDataURL()} : null};
})()"""


def chromium_binary() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    return path


class DevTools:
    """One page of a headless Chromium, over the DevTools protocol (flat sessions)."""

    def __init__(self, ws: Any, session: str) -> None:
        self.ws = ws
        self.session = session
        self._ids = itertools.count(1)

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True,
             timeout_s: float = 15.0) -> dict[str, Any]:
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == msg_id:  # events and other replies are skipped
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: Path) -> int:
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return len(data)


@contextlib.contextmanager
def browser(url: str, profile: Path) -> Iterator[DevTools]:
    """Headless Chromium with a fresh profile, showing `url`."""
    ws_client = pytest.importorskip("websockets.sync.client", reason="websockets comes with the [test] extra")
    proc = subprocess.Popen([chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port_file = profile / "DevToolsActivePort"

        def endpoint() -> str | None:
            assert proc.poll() is None, f"chromium exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
            lines = port_file.read_text().split() if port_file.exists() else []
            return f"ws://127.0.0.1:{lines[0]}{lines[1]}" if len(lines) >= 2 else None

        with ws_client.connect(eventually(endpoint, 30, "chromium DevTools endpoint"), max_size=None,
                               open_timeout=10) as ws:
            root = DevTools(ws, "")
            target = root.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
            session = root.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                session=False)["sessionId"]
            page = DevTools(ws, session)
            page._ids = root._ids
            page.call("Page.enable")
            page.call("Emulation.setDeviceMetricsOverride",
                      {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
            page.call("Page.navigate", {"url": url})
            eventually(lambda: page.evaluate("document.readyState === 'complete' && !!document.getElementById('tps')"
                                             f" && location.href === {json.dumps(url)}"), 30, f"{url} loaded")
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_expert_map_on_a_live_cluster(tmp_path: Path) -> None:
    chromium_binary()
    t0 = time.monotonic()
    model = build_model(tmp_path / "models", "demo")
    args = ModelArgs.from_dict(json.loads((model / "moetier.json").read_text())["model"])
    layers, experts = len(args.moe_layer_ids), args.n_routed_experts
    with local_cluster(tmp_path / "cluster", model) as cluster, traffic(cluster) as load, \
            browser(f"{cluster.url}/dashboard", tmp_path / "chromium") as page:
        started = time.monotonic()
        first = eventually(lambda: (s := page.evaluate(STATE_JS))["map"] and s["map"]["step"] > 0 and s, 60,
                           "the map drawn from a store's heat")
        m = first["map"]
        assert (m["layers"], m["experts"], m["cells"]) == (layers, experts, layers * experts)
        assert first["status"] == "ok" and first["heat"] == "ok" and first["banner"] is None

        # While traffic runs the map keeps changing: new steps, new pixels.
        def changed() -> dict[str, Any] | None:
            s = page.evaluate(STATE_JS)
            return s if s["map"]["step"] > m["step"] and s["map"]["image"] != m["image"] else None

        later = eventually(changed, 30, "the map changing under traffic")
        # The live figures come in once two polls span some generated tokens.
        shown = eventually(lambda: (s := page.evaluate(STATE_JS))["tps"] not in ("–", "0.0")
                           and s["hit"] != "–" and s["ttft"] != "–" and s, 30, "tokens/s, TTFT and hit rate shown")
        size = page.screenshot(SCREENSHOT)
        assert size > 20_000, f"screenshot of {size} bytes: is the page blank?"
        # the figures come from tokens of requests under way: wait for one to be answered
        eventually(lambda: load.ok > 0 or load.errors, 60, "a traffic request answered")
        assert load.ok > 0 and not load.errors, load.errors[:3]
        elapsed = time.monotonic() - started
    print(f"\nexpert map: {layers} x {experts} cells, step {m['step']} -> {later['map']['step']}, "
          f"tokens/s {shown['tps']}, TTFT {shown['ttft']}, hit rate {shown['hit']}; screenshot {SCREENSHOT} "
          f"({size} bytes); model {started - t0:.1f} s, page {elapsed:.1f} s")


def test_page_says_when_no_store_answers(tmp_path: Path) -> None:
    chromium_binary()
    model = ServedModel.from_dir(make_model_dir(tmp_path / "models"))
    # The gateway tests' fake router lists a store without an address: its Heat fails at once.
    with served(model) as gw, browser(f"{gw.url}/dashboard", tmp_path / "chromium") as page:
        state = eventually(lambda: (s := page.evaluate(STATE_JS))["banner"] and s, 20, "the no-store banner")
    assert state["heat"] == "stores_unreachable" and state["status"] == "error"
    assert "No expert store reachable" in state["banner"] and state["map"] is None
