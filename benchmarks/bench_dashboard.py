"""What an open /dashboard costs: the same loads with and without a poller doing what the page
does (its files once, then GET /v1/status?since=T once per status interval), side by side on
one cluster, alternating off/on so drift hits both alike.

    .venv/bin/python benchmarks/bench_dashboard.py [--model smollm2-135m] [--repeats 3]
        [--duration-s 30] [--pollers 1]

Two loads, on one 1P1D cluster (one core per worker when the machine has two):
  - decode: 32 streaming requests at once (a short prompt, `--decode-tokens` each, EOS ignored),
    a new one as each ends; output tokens per second.
  - chat: `--chat-users` closed-loop users sending chat requests (`--chat-prompt-tokens`
    prompt, `--chat-max-tokens`); goodput = finished requests per second meeting the SLO
    (TTFT <= --slo-ttft-ms and mean TPOT <= --slo-tpot-ms).
Prints one row per load: median of the runs without and with the dashboard, and the gap.
Run it on a quiet machine: other processes' noise is larger than the effect measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import aiohttp

from pdserve.cluster.config import Pipeline, Role
from pdserve.cluster.launcher import Cluster, free_port

ASSETS = ("/dashboard", "/dashboard/uPlot.min.css", "/dashboard/uPlot.iife.min.js",
          "/dashboard/dashboard.js")  # fmt: skip


async def poll_dashboard(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> int:
    """The page's traffic; returns how many status polls it made."""
    for path in ASSETS:
        async with http.get(url + path) as resp:
            await resp.read()
    since, num_polls = 0.0, 0
    while not stop.is_set():
        async with http.get(f"{url}/v1/status?since={since}") as resp:
            status = await resp.json()
        num_polls += 1
        if status["history"]:
            since = status["history"][-1]["t"]
        try:
            await asyncio.wait_for(stop.wait(), status["interval_s"])
        except TimeoutError:
            pass
    return num_polls


async def stream_one(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT s, mean TPOT s, output tokens) of one streamed request."""
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b'data: {"id"') and b'"usage"' in line:
                num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif line.startswith(b"data: {"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None and num_tokens, "no token streamed"
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return first - start, tpot, num_tokens


async def closed_loop(num_users: int, duration_s: float, send) -> list[tuple[float, float, int]]:
    deadline = time.perf_counter() + duration_s
    results: list[tuple[float, float, int]] = []

    async def user() -> None:
        while time.perf_counter() < deadline:
            results.append(await send())

    await asyncio.gather(*(user() for _ in range(num_users)))
    return results


async def run_once(args: argparse.Namespace, url: str, load: str, dashboard: bool) -> float:
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        stop = asyncio.Event()
        pollers = [
            asyncio.create_task(poll_dashboard(http, url, stop))
            for _ in range(args.pollers if dashboard else 0)
        ]
        start = time.perf_counter()
        if load == "decode":
            body = {"model": args.model, "prompt": "Once upon a time", "ignore_eos": True,
                    "max_tokens": args.decode_tokens, "temperature": 0}  # fmt: skip
            results = await closed_loop(
                32, args.duration_s, lambda: stream_one(http, f"{url}/v1/completions", body)
            )
            value = sum(n for _, _, n in results) / (time.perf_counter() - start)
        else:
            words = " ".join(["cluster"] * args.chat_prompt_tokens)
            body = {"model": args.model, "max_tokens": args.chat_max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Summarize: {words}"}]}  # fmt: skip
            results = await closed_loop(
                args.chat_users,
                args.duration_s,
                lambda: stream_one(http, f"{url}/v1/chat/completions", body),
            )
            good = [
                r for r in results
                if r[0] * 1000 <= args.slo_ttft_ms and r[1] * 1000 <= args.slo_tpot_ms
            ]  # fmt: skip
            value = len(good) / (time.perf_counter() - start)
        stop.set()
        num_polls = sum(await asyncio.gather(*pollers))
    print(f"  {load:6} dashboard={'on ' if dashboard else 'off'} {value:9.2f}"
          f"  ({len(results)} requests, {num_polls} status polls)", flush=True)  # fmt: skip
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--pollers", type=int, default=1, help="open dashboards during 'on' runs")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--chat-prompt-tokens", type=int, default=200)
    p.add_argument("--chat-max-tokens", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= 2
    role = {"threads": 1 if pin else None, "kv_cache_bytes": args.kv_cache_bytes}
    pipeline = Pipeline(
        model=args.model, port=free_port(),
        prefill=Role(cpus=(cores[0],) if pin else (), **role),
        decode=Role(cpus=(cores[1],) if pin else (), **role),
    )  # fmt: skip
    rows = {}
    with Cluster(pipeline, log_level="WARNING") as url:
        for load in ("decode", "chat"):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for dashboard in (False, True):
                    runs[dashboard].append(asyncio.run(run_once(args, url, load, dashboard)))
            off, on = statistics.median(runs[False]), statistics.median(runs[True])
            rows[load] = {"off": off, "on": on, "gap_percent": 100 * (off - on) / off}
    unit = {"decode": "output tok/s (batch 32)", "chat": "goodput req/s (1P1D chat)"}
    print("\n| load | without dashboard | with dashboard | gap |\n| --- | --- | --- | --- |")
    for load, r in rows.items():
        print(f"| {unit[load]} | {r['off']:.2f} | {r['on']:.2f} | {r['gap_percent']:+.2f}% |")
    print(json.dumps({"args": vars(args), "results": rows}))


if __name__ == "__main__":
    main()
