"""What a running deployment's router answers over plain HTTP, for the scripts that check a run
left nothing behind (benchmarks/chaos_soak.py and netns.py): one
completion posted, a metric's samples and each worker's KV blocks from `/metrics`, and the
blocks still held once every request is over."""

from __future__ import annotations

import json
import re
import time
import urllib.request


def post_completion(url: str, body: dict, timeout_s: float, timing: bool = False) -> dict:
    """The JSON answer of a non-streamed `/v1/completions`; `timing` asks for the router's
    `pdserve_timing` (X-PDServe-Timing)."""
    headers = {"Content-Type": "application/json", **({"X-PDServe-Timing": "1"} if timing else {})}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str, name: str) -> dict[str, float]:
    """Each labelled sample of the metric `name` in a `/metrics` text: its labels as written
    (`worker="p0",reason="..."`) -> its value."""
    pattern = rf"^{name}\{{([^}}]*)\}} (\S+)$"
    return {labels: float(value) for labels, value in re.findall(pattern, text, re.MULTILINE)}


def kv_blocks(text: str) -> dict[str, tuple[int, int]]:
    """(free, total) KV blocks of each worker in a `/metrics` text."""
    free = dict(re.findall(r'pdserve_kv_blocks_free\{worker="([^"]+)"\} (\d+)', text))
    total = dict(re.findall(r'pdserve_kv_blocks_total\{worker="([^"]+)"\} (\d+)', text))
    return {w: (int(free[w]), int(total[w])) for w in free}


def leaked_blocks(url: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Blocks each worker still holds once every request is over: polled until none is, or
    for `timeout_s`."""
    deadline, left = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        left = {w: t - f for w, (f, t) in kv_blocks(metrics_text(url)).items() if f != t}
        if not left:
            break
        time.sleep(0.5)
    return left
