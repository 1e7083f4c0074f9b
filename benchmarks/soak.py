"""Soak test (not in CI): a fixed request rate at ~80% of measured capacity for N minutes.

It answers "does a long run leak or degrade?": errors, p99 TTFT/latency per window over
time, router and worker RSS at start and end, and KV blocks free at the end (all of them must
be, once the load stops).

    python benchmarks/soak.py --model smollm2-135m --prefill 1 --decode 1 --minutes 10
    python benchmarks/soak.py --url http://127.0.0.1:8000 --model NAME     # a running server

Capacity is measured first with a closed loop of --concurrency clients (skip it with
--rate). RSS comes from /proc/<pid>/status of every `pdserve.router.main` and
`pdserve.workers.main` process on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.bench.client import ClientConfig, send_request  # noqa: E402
from pdserve.bench.metrics import OK, RequestRecord  # noqa: E402

PIDS: list[int] = []  # the cluster this script started; empty: every pdserve process here


def pdserve_rss_mib() -> dict[str, float]:
    """Resident memory of the pdserve router/worker processes, by a readable name."""
    out = {}
    for pid in PIDS or filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "pdserve.router.main" in cmdline:
            name = f"router[{pid}]"
        elif "pdserve.workers.main" in cmdline:
            found = re.search(r'"worker_id": "([^"]+)"', cmdline)
            name = f"{found.group(1) if found else 'worker'}[{pid}]"
        else:
            continue
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        if rss:
            out[name] = int(rss.group(1)) / 1024
    return out


def kv_blocks(url: str) -> dict[str, tuple[int, int]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    free = dict(re.findall(r'pdserve_kv_blocks_free\{worker="([^"]+)"\} (\d+)', text))
    total = dict(re.findall(r'pdserve_kv_blocks_total\{worker="([^"]+)"\} (\d+)', text))
    return {w: (int(free[w]), int(total[w])) for w in free}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = ClientConfig(url=args.url, model=args.model, api_key=args.api_key)
        self.rng = random.Random(0)
        self.start = time.perf_counter()
        self.records: list[RequestRecord] = []

    def prompt(self) -> list[int]:
        return [self.rng.randrange(40, 120) for _ in range(self.args.input_len)]

    async def one(self, http: aiohttp.ClientSession) -> RequestRecord:
        record = RequestRecord(str(len(self.records)), self.args.input_len, self.args.output_len)
        self.records.append(record)
        await send_request(http, self.cfg, self.prompt(), record, self.start)
        return record

    async def capacity(self, http: aiohttp.ClientSession) -> float:
        """Requests per second a closed loop of --concurrency clients completes."""
        end = time.perf_counter() + self.args.capacity_s
        done = 0

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                done += (await self.one(http)).status == OK

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))
        return done / (time.perf_counter() - t0)

    async def soak(self, http: aiohttp.ClientSession, rate: float) -> list[dict]:
        """Open loop at `rate` req/s (fixed interval) for --minutes; one report per window."""
        windows, tasks = [], []
        t0 = time.perf_counter()
        end = t0 + 60 * self.args.minutes
        next_send, next_report, first = t0, t0 + self.args.window_s, len(self.records)
        while time.perf_counter() < end:
            now = time.perf_counter()
            if now >= next_send:
                tasks.append(asyncio.create_task(self.one(http)))
                next_send += 1 / rate
            if now >= next_report:
                windows.append(self.report(first, now - t0))
                first, next_report = len(self.records), next_report + self.args.window_s
            await asyncio.sleep(max(0.0, min(next_send, next_report) - time.perf_counter()))
        await asyncio.gather(*tasks)
        windows.append(self.report(first, time.perf_counter() - t0))
        return windows

    def report(self, first: int, at_s: float) -> dict:
        batch = self.records[first:]
        ok = [r for r in batch if r.status == OK]
        row = {
            "at_s": round(at_s, 1),
            "sent": len(batch),
            "ok": len(ok),
            "errors": {
                s: sum(r.status == s for r in batch) for s in {r.status for r in batch} - {OK}
            },
            "p50_ttft_s": pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.5),
            "p99_ttft_s": pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.99),
            "p99_e2e_s": pct([r.e2e_s for r in ok if r.e2e_s is not None], 0.99),
        }
        print(json.dumps(row), flush=True)
        return row


async def run(args: argparse.Namespace) -> dict:
    load = Load(args)
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        rate = args.rate
        capacity = None
        if rate is None:
            capacity = await load.capacity(http)
            rate = args.load_fraction * capacity
            print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s", flush=True)
        rss_start = pdserve_rss_mib()
        windows = await load.soak(http, rate)
    time.sleep(args.drain_s)  # deadlines and the last Stats report
    blocks = kv_blocks(args.url)
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "windows": windows,
        "rss_mib_start": rss_start,
        "rss_mib_end": pdserve_rss_mib(),
        "kv_blocks_end": blocks,
        "all_blocks_free": all(f == t for f, t in blocks.values()),
        "num_errors": sum(r.status != OK for r in load.records),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server; default: start a cluster here")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    ap.add_argument("--prefill", type=int, default=1, help="workers, when starting a cluster")
    ap.add_argument("--decode", type=int, default=1, help="workers, when starting a cluster")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, help="req/s; default: --load-fraction of capacity")
    ap.add_argument("--load-fraction", type=float, default=0.8)
    ap.add_argument("--capacity-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--drain-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, help="write the summary JSON here")
    args = ap.parse_args()
    if args.url:
        summary = asyncio.run(run(args))
    else:
        from pdserve.cluster.config import Pipeline, Role
        from pdserve.cluster.launcher import Cluster, free_port

        pipeline = Pipeline(
            model=args.model, port=free_port(), api_key=args.api_key,
            prefill=Role(num=args.prefill), decode=Role(num=args.decode),
        )  # fmt: skip
        cluster = Cluster(pipeline, log_level="WARNING")
        with cluster as url:
            args.url = url
            PIDS.extend(p.popen.pid for p in cluster.processes)
            summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if summary["all_blocks_free"] else 1


if __name__ == "__main__":
    sys.exit(main())
