"""Chaos soak (not in CI; BENCHMARKS.md, "Failures"): a supervised 1P2D cluster with a local
Redis tier serves prompts sharing prefixes, Poisson at `--rate`, while a random worker is
SIGKILLed every `--kill-every-s`, the router `--router-kills` times and Redis paused
`--redis-pauses` times. Exit status 0 only if every request ends in success or a clean error
within `--request-bound-s`, every success equals a collocated reference run's, every KV block
is free once the cluster is whole, and no process or /dev/shm pool is left after stop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.bench.client import ClientConfig, send_request
from pdserve.bench.metrics import OK, RequestRecord, latency_stats_ms
from pdserve.bench.router_stats import kv_blocks, metrics_text
from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.cluster.supervisor import RestartPolicy
from pdserve.kvstore.config import KVStoreConfig
from pdserve.transfer.shm import SHM_DIR, sweep_orphans

WORKERS = ("prefill-0", "decode-0", "decode-1")
DEFAULTS = dict(minutes=20.0, kill_every_s=60.0, router_kills=2, redis_pauses=1, redis_pause_s=20.0)
DEFAULTS |= dict(request_bound_s=180.0, num_prompts=48, num_prefixes=4, prefix_len=160, seed=0)
DEFAULTS |= dict(max_suffix_len=64, max_output_len=32)


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    max_tokens: int


def prompt_pool(args: argparse.Namespace) -> list[Item]:
    """--num-prompts prompts over --num-prefixes shared prefixes (system-prompt-like), each
    with its own suffix and output length."""
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    return [
        Item(
            prefixes[i % args.num_prefixes] + ids(rng.randint(8, args.max_suffix_len)),
            rng.randint(8, args.max_output_len),
        )
        for i in range(args.num_prompts)
    ]


async def send_at(url: str, items: list[Item], times: list[float], args, limit: int) -> list:
    """Each item sent at its time (s after the start), at most `limit` at once: (record, text)."""
    cfg = ClientConfig(url=url, model=args.model, request_timeout_s=args.request_bound_s)
    sem = asyncio.Semaphore(limit)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        start = time.perf_counter()

        async def run(item: Item, at: float) -> tuple[RequestRecord, str]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with sem:
                record = RequestRecord("", len(item.prompt), item.max_tokens)
                return record, await send_request(http, cfg, item.prompt, record, start)

        return await asyncio.gather(*(run(item, at) for item, at in zip(items, times)))


def reference(url: str, pool: list[Item], args: argparse.Namespace) -> list[str]:
    """The pool's greedy texts, 4 at a time."""
    answers = asyncio.run(send_at(url, pool, [0.0] * len(pool), args, 4))
    if failed := [r.error for r, _ in answers if r.status != OK]:
        raise RuntimeError(f"reference request failed: {failed[0]}")
    return [text for _, text in answers]


def load(url: str, pool: list[Item], args: argparse.Namespace) -> list[tuple]:
    """Open loop at --rate (Poisson) for --minutes, uniform over the pool (whole prompts repeat,
    prefixes are shared): (pool index, record, text) each."""
    rng, times = random.Random(args.seed + 1), [0.0]
    while times[-1] + (gap := rng.expovariate(args.rate)) < 60 * args.minutes:
        times.append(times[-1] + gap)
    picks = [rng.randrange(len(pool)) for _ in times]
    answers = asyncio.run(send_at(url, [pool[i] for i in picks], times, args, len(times)))
    return [(i, record, text) for i, (record, text) in zip(picks, answers)]


class Chaos(threading.Thread):
    """Applies the failure schedule to the cluster's current processes; `events` logs what
    was done when (seconds from the start of the load)."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        super().__init__(daemon=True)
        self.cluster, self.args = cluster, args
        self.events: list[tuple[float, str]] = []
        self.stop = threading.Event()
        duration = 60 * args.minutes
        rng = random.Random(args.seed + 2)
        plan = [
            (t, "kill", rng.choice(WORKERS))
            for t in range(int(args.kill_every_s / 2), int(duration - 30), int(args.kill_every_s))
        ]
        plan += [
            (duration * (k + 1) / (args.router_kills + 1) + 15, "kill", "router")
            for k in range(args.router_kills)
        ]
        plan += [
            (duration * (k + 0.5) / max(1, args.redis_pauses) + 5, "pause", "redis")
            for k in range(args.redis_pauses)
        ]
        self.plan = sorted(plan)

    def run(self) -> None:
        t0 = time.monotonic()
        for at, action, name in self.plan:
            if self.stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            popen = next(p.popen for p in self.cluster.processes if p.name == name)
            if popen.poll() is not None:
                self.events.append((round(time.monotonic() - t0, 1), f"{name} already down"))
                continue
            for sig in [signal.SIGKILL] if action == "kill" else [signal.SIGSTOP, signal.SIGCONT]:
                if sig == signal.SIGCONT:
                    self.stop.wait(self.args.redis_pause_s)
                popen.send_signal(sig)
                self.events.append((round(time.monotonic() - t0, 1), f"{sig.name} {name}"))


def wait_whole(url: str, timeout_s: float) -> dict[str, tuple[int, int]]:
    """Every worker healthy and every block free, or the last blocks seen at the timeout."""
    deadline, blocks = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                healthy = all(w["healthy"] for w in json.loads(resp.read())["workers"].values())
            blocks = kv_blocks(metrics_text(url))
            if healthy and set(blocks) == set(WORKERS):
                if all(free == total for free, total in blocks.values()):
                    return blocks
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    return blocks


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def summarize(results, refs, pool, blocks, pids, pools_left, events, args) -> dict:
    statuses = Counter(r.status for _, r, _ in results)
    errors = Counter((r.error or "")[:60] for _, r, _ in results if r.status != OK)
    ok = [(i, r, t) for i, r, t in results if r.status == OK]
    wrong = [i for i, r, t in ok if t != refs[i] or r.output_len != pool[i].max_tokens]
    ends = [r.e2e_s for _, r, _ in results if r.e2e_s is not None]
    checks = {
        "every_request_ended_in_bound": statuses.get("timeout", 0) == 0
        and max(ends, default=0) <= args.request_bound_s,
        "outputs_equal_reference": not wrong,
        "blocks_back_to_baseline": bool(blocks)
        and set(blocks) == set(WORKERS)
        and all(f == t for f, t in blocks.values()),
        "no_process_left": not [p for p in pids if alive(p)],
        "no_shm_pool_left": not pools_left,
    }
    return {
        "checks": checks,
        "requests": len(results),
        "statuses": dict(statuses),
        "errors": dict(errors.most_common(8)),
        "num_wrong_outputs": len(wrong),
        "max_end_s": round(max(ends, default=0), 2),
        "e2e_ok_ms": latency_stats_ms(r.e2e_s for _, r, _ in ok),
        "ttft_ok_ms": latency_stats_ms(r.ttft_s for _, r, _ in ok if r.ttft_s is not None),
        "cached_prompt_tokens_ok": sum(r.cached_tokens or 0 for _, r, _ in ok),
        "prompt_tokens_ok": sum(r.input_len for _, r, _ in ok),
        "kv_blocks_end": blocks,
        "processes_started": len(pids),
        "shm_pools_left": pools_left,
        "events": events,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rate", type=float, default=0.3, help="requests per second (Poisson)")
    ap.add_argument("--kv-cache-mib", type=int, default=96, help="per worker: small, so L4 is used")
    ap.add_argument("--out", type=Path, help="write the summary JSON here")
    for name, default in DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = ap.parse_args()
    pool = prompt_pool(args)
    shm_before = set(os.listdir(SHM_DIR))
    one_thread = {"threads": 1, "kv_cache_bytes": args.kv_cache_mib * 2**20}

    t = time.monotonic()
    ref_pipeline = Pipeline(
        model=args.model, port=free_port(), collocated=WorkerGroup(**one_thread)
    )
    with Cluster(ref_pipeline, log_level="WARNING", restart=None) as url:
        refs = reference(url, pool, args)
    print(f"reference: {len(refs)} prompts in {time.monotonic() - t:.0f} s", flush=True)

    pipeline = Pipeline(
        model=args.model,
        port=free_port(),
        prefill=WorkerGroup(**one_thread),
        decode=WorkerGroup(num=2, **one_thread),
        kv_pool=KVStoreConfig(redis_url="local"),
    )
    # A restart budget above what the schedule kills (about one worker a minute).
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=10.0, max_restarts=30, window_s=600.0)
    cluster = Cluster(pipeline, log_level="WARNING", restart=policy)
    with cluster as url:
        chaos = Chaos(cluster, args)
        chaos.start()
        results = load(url, pool, args)
        chaos.stop.set()
        chaos.join()
        blocks = wait_whole(url, 180)
        cluster.check_alive()  # the supervisor did not give up
    pids = cluster.supervisor.pids if cluster.supervisor else []
    time.sleep(1)
    # Pools no live process holds (their creator's flock), made by this run, removed.
    left = [name for name in sweep_orphans() if name not in shm_before]
    summary = summarize(results, refs, pool, blocks, pids, left, chaos.events, args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
