"""/dashboard in a real browser: headless Chromium (Debian's `chromium`, .ci/run installs it)
opens the page of a live 1P1D cluster under load, driven over the Chrome DevTools Protocol
with aiohttp's websocket client. The rendered page must list every worker with its role, draw
charts with data points, and log no console error; the screenshot is saved (to docs/img with
PDSERVE_UPDATE_SCREENSHOT=1, which is how the one in docs/observability.md was made). An
adaptive cluster's page adds the planner's panel: core groups, decisions, threads chart."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.cluster.config import WorkerGroup
from pdserve.planner.config import AdaptiveConfig
from tests.cluster.conftest import KV_BYTES, post, role, start

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_SCREENSHOT = Path(__file__).parents[2] / "docs" / "img" / "dashboard.png"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt install chromium)"),
]


class Page:
    """One browser tab over CDP: `call` a method, errors collected as they are logged."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                self._waiting.pop(data["id"]).set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                self.errors.append(" ".join(str(a.get("value", a)) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.errors.append(params["entry"]["text"])

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._waiting[call_id] = asyncio.get_running_loop().create_future()
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        reply = await asyncio.wait_for(self._waiting[call_id], 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


# What the page shows, read from its DOM and its uPlot instances (`charts`, dashboard.js).
_RENDERED = """({
  workers: [...document.querySelectorAll('#workers tbody tr')].map(
      tr => [tr.dataset.worker, tr.querySelector('.role').textContent]),
  charts: Object.fromEntries(Object.entries(charts).map(([key, c]) => [key,
      c.plot.data.slice(1).map(s => s.filter(v => v !== null).length)])),
  canvases: document.querySelectorAll('.chart canvas').length,
  planner: document.getElementById('planner').hidden ? null : {
    summary: document.getElementById('planner-summary').textContent,
    targets: document.getElementById('planner-targets').textContent,
    groups: [...document.querySelectorAll('#core-groups tbody tr')].map(
        tr => [...tr.children].map(td => td.textContent)),
    counts: document.querySelectorAll('#decision-counts tbody tr').length,
    decisions: [...document.querySelectorAll('#decisions tbody tr')].map(
        tr => [...tr.children].map(td => td.textContent)),
  },
})"""


async def open_dashboard(
    url: str, screenshot: Path, charts: set[str], timeout_s: float = 60
) -> dict[str, Any]:
    profile = tempfile.mkdtemp(prefix="pdserve-chromium-")
    browser = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1400,1100",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                target = next(t for t in await resp.json() if t["type"] == "page")
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Runtime", "Log", "Page"):
                    await page.call(f"{domain}.enable")
                await page.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=1400,
                    height=1000,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                await page.call("Page.navigate", url=f"{url}/dashboard")
                deadline = time.monotonic() + timeout_s
                while True:  # until every chart has points (the page polls once a second)
                    await asyncio.sleep(1)
                    shown = await page.evaluate("typeof charts === 'object' && " + _RENDERED)
                    series = (shown or {}).get("charts", {})
                    drawn = {k for k, counts in series.items() if counts and max(counts) >= 3}
                    if charts <= drawn:
                        break
                    if time.monotonic() > deadline:
                        break
                shot = await page.call(
                    "Page.captureScreenshot", format="png", captureBeyondViewport=True
                )
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                return {**(shown or {}), "errors": page.errors}
    finally:
        browser.terminate()
        browser.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def load(url: str, model: str, stop: threading.Event) -> None:
    prompts = itertools.cycle(["Tell me about the sea. " * n for n in (1, 3, 6, 9)])
    while not stop.is_set():
        body = {"model": model, "prompt": next(prompts), "max_tokens": 24, "ignore_eos": True}
        post(url, "/v1/completions", body)


def test_dashboard_renders_a_live_cluster(tiny_served_model: Path, tmp_path: Path) -> None:
    model = str(tiny_served_model)
    with start(tiny_served_model, prefill=role(), decode=role()) as url:
        stop = threading.Event()
        clients = [threading.Thread(target=load, args=(url, model, stop)) for _ in range(3)]
        for client in clients:
            client.start()
        try:
            shot = DOCS_SCREENSHOT if os.environ.get("PDSERVE_UPDATE_SCREENSHOT") else None
            screenshot = shot or tmp_path / "dashboard.png"
            charts = {"ttft", "tpot", "rate", "kv", "transfer"}
            shown = asyncio.run(open_dashboard(url, screenshot, charts))
        finally:
            stop.set()
            for client in clients:
                client.join(60)
    assert shown["errors"] == []
    assert sorted(shown["workers"]) == [["decode-0", "decode"], ["prefill-0", "prefill"]]
    for chart in ("ttft", "tpot", "itl", "rate", "queue", "kv", "transfer"):
        assert max(shown["charts"][chart]) >= 3, (chart, shown["charts"])
    assert shown["canvases"] >= len(shown["charts"])
    assert shown["planner"] is None and "cores" not in shown["charts"]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dashboard_draws_the_adaptive_planner(tiny_served_model: Path, tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("an adaptive deployment needs two cores")
    model = str(tiny_served_model)
    # A target no local prefill meets: the planner sends prefills remote and moves cores.
    adaptive = AdaptiveConfig(enabled=True, slo_itl_ms=0.001)
    workers = WorkerGroup(kv_cache_bytes=KV_BYTES)
    with start(tiny_served_model, adaptive=adaptive, workers=workers) as url:
        stop = threading.Event()
        clients = [threading.Thread(target=load, args=(url, model, stop)) for _ in range(3)]
        for client in clients:
            client.start()
        try:
            charts = {"ttft", "rate", "cores"}
            shown = asyncio.run(open_dashboard(url, tmp_path / "adaptive.png", charts))
        finally:
            stop.set()
            for client in clients:
                client.join(60)
    assert shown["errors"] == []
    planner = shown["planner"]
    assert planner["summary"].startswith("split 1 prefill : 1 decode"), planner
    assert "ITL 0.001 ms" in planner["targets"] and "stall budget" in planner["targets"]
    assert sorted(g[1:3] for g in planner["groups"]) == [
        ["worker-0", "prefill"],
        ["worker-1", "decode"],
    ]
    assert sum(int(g[4]) for g in planner["groups"]) <= len(os.sched_getaffinity(0))
    assert planner["counts"] >= 1 and planner["decisions"], planner
    assert {d[2] for d in planner["decisions"]} <= {"local", "remote"}
    assert all(d[3] for d in planner["decisions"])  # every decision shows its reason
    assert max(shown["charts"]["cores"]) >= 3, shown["charts"]
