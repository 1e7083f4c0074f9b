"""Ray placement vs the embedded launcher, side by side on one machine (docs/cluster.md).

    .venv/bin/python benchmarks/bench_ray.py [--model smollm2-135m] [--repeats 3]
        [--requests 8] [--prompt-tokens 256] [--max-tokens 64] [--tokens 2048]

A two-node Ray cluster is made on this machine (`ray.cluster_utils.Cluster`, two raylets
offering `prefill_pool` and `decode_pool`) unless `--ray-address` names one. Four tables:
  1. start-up of a 1P2D deployment (enter to /health ok): embedded vs Ray (Ray already up;
     the Ray cluster's own start is printed apart), median of `--repeats`, alternating;
  2. KV transfer bandwidth between two Ray actors: on different Ray nodes (`auto` -> tcp) vs
     on one node (`auto` -> shm); `--tokens` of SmolLM2-135M's KV, driver-timed from the send
     to the receiver's DONE (two Ray calls, ~1 ms, are included);
  3. from SIGKILL of decode-0, once all `--requests` streams have their first token, to the
     last one finishing (decode-0's are re-driven on decode-1), embedded vs Ray;
  4. TTFT and mean TPOT of the same workload (`--requests` streams at once), embedded vs Ray,
     alternating runs, medians.
Figures taken while other processes run are noisy: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import SECRET, smollm_layout  # noqa: E402

from pdserve import envs  # noqa: E402
from pdserve.cluster.config import Pipeline, Role  # noqa: E402
from pdserve.cluster.launcher import Cluster, free_port  # noqa: E402
from pdserve.cluster.ray import RayCluster  # noqa: E402


def pipeline(args, placement: str, num_decode: int = 2) -> Pipeline:
    pools = placement == "ray"
    prefill = Role(threads=1, ray_resources={"prefill_pool": 1} if pools else None)
    decode = Role(num=num_decode, threads=1, ray_resources={"decode_pool": 1} if pools else None)
    return Pipeline(model=args.model, prefill=prefill, decode=decode, port=free_port(),
                    placement=placement)  # fmt: skip


def make(args, placement: str) -> Cluster:
    cls = RayCluster if placement == "ray" else Cluster
    return cls(pipeline(args, placement), log_level="WARNING")


# ---- 1. start-up ---------------------------------------------------------------------------


def bench_startup(args) -> dict[str, float]:
    times: dict[str, list[float]] = {"embedded": [], "ray": []}
    for _ in range(args.repeats):
        for name, placement in (("embedded", "local"), ("ray", "ray")):
            cluster = make(args, placement)
            start = time.perf_counter()
            with cluster:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


# ---- 2. transfer bandwidth between Ray actors ---------------------------------------------


class Endpoint:
    """A receiver or a sender of one KV layout, in a Ray actor, `auto` backend: shm with a peer
    on the same Ray node, tcp otherwise (the node is the host identity, as for workers)."""

    def __init__(self, num_tokens: int) -> None:
        import torch

        from pdserve.transfer import make_receiver, make_sender
        from pdserve.transfer.shm import create_shared_kv

        envs.set_host_id(f"ray-node/{ray.get_runtime_context().get_node_id()}")
        self.layout = smollm_layout(num_tokens)
        ip = ray.util.get_node_ip_address()
        rx_kv, self.shm_name = create_shared_kv(self.layout)
        rx_kv.zero_()
        self.rx = make_receiver("auto", rx_kv, self.layout, SECRET, host=ip)
        self.tx = make_sender("auto", torch.randn(self.layout.shape), self.layout, SECRET)

    def address(self) -> dict:
        return self.rx.address()

    def send(self, peer: dict, request_id: str) -> None:
        ids = list(range(self.layout.num_blocks))
        self.tx.send(peer, request_id, list(range(self.layout.num_layers)), ids, ids, last=True)

    def expect(self, request_id: str) -> None:
        self.rx.expect(request_id, list(range(self.layout.num_blocks)))

    def wait_done(self, request_id: str) -> str:
        while True:
            for rid, status, error in self.rx.pop_finished():
                if rid == request_id:
                    self.rx.release(rid)
                    return f"{status.name} {error or ''}"
            time.sleep(0.0002)


def bench_bandwidth(args) -> dict[str, float]:
    actor = ray.remote(Endpoint)
    a = actor.options(num_cpus=0, resources={"prefill_pool": 0.01}).remote(args.tokens)
    b = actor.options(num_cpus=0, resources={"decode_pool": 0.01}).remote(args.tokens)
    b2 = actor.options(num_cpus=0, resources={"decode_pool": 0.01}).remote(args.tokens)
    layout = smollm_layout(args.tokens)
    nbytes = layout.num_layers * layout.num_blocks * layout.block_bytes
    out = {}
    for name, (tx, rx) in {"between nodes (tcp)": (a, b), "within a node (shm)": (b2, b)}.items():
        peer = ray.get(rx.address.remote())
        times = []
        for i in range(args.repeats + 1):  # the first connects and maps: not counted
            rid = f"{name[:3]}-{i}"
            ray.get(rx.expect.remote(rid))
            start = time.perf_counter()
            ray.get(tx.send.remote(peer, rid))
            status = ray.get(rx.wait_done.remote(rid))
            assert status.startswith("DONE"), status
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    for handle in (a, b, b2):
        ray.kill(handle)
    return out


# ---- 3./4. requests --------------------------------------------------------------------------


async def stream_one(
    http, url: str, model: str, args, index: int, first: asyncio.Queue | None = None
) -> tuple[float, float]:
    """(TTFT s, mean TPOT s) of one streamed request; `first` hears of its first token."""
    body = {"model": model, "prompt": [40 + (index + i) % 80 for i in range(args.prompt_tokens)],
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.perf_counter()
    stamps = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                if first is not None and len(stamps) == 1:
                    first.put_nowait(index)
    tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return stamps[0] - start, tpot


async def run_load(url: str, args, first: asyncio.Queue | None = None) -> list[tuple[float, float]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        coros = [stream_one(http, url, args.model, args, i, first) for i in range(args.requests)]
        return await asyncio.gather(*coros)


def bench_latency(args) -> dict[str, tuple[float, float]]:
    samples: dict[str, list[tuple[float, float]]] = {"embedded": [], "ray": []}
    for _ in range(args.repeats):
        for name, placement in (("embedded", "local"), ("ray", "ray")):
            with make(args, placement) as url:
                asyncio.run(run_load(url, args))  # warm-up
                samples[name] += asyncio.run(run_load(url, args))
    return {k: (statistics.median(t for t, _ in v) * 1e3, statistics.median(p for _, p in v) * 1e3)
            for k, v in samples.items()}  # fmt: skip


def decode_pid(cluster: Cluster, worker_id: str) -> int:
    if isinstance(cluster, RayCluster):
        return int(ray.get(cluster.workers[worker_id].placed.remote())["pid"])
    return next(p.popen.pid for p in cluster.processes if p.name == worker_id)


async def load_and_kill(cluster: Cluster, url: str, args) -> float:
    """Kill decode-0 once every request streams (so each is decoding on a decode worker)."""
    first: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(run_load(url, args, first))
    for _ in range(args.requests):
        await first.get()
    killed = time.perf_counter()
    os.kill(decode_pid(cluster, "decode-0"), signal.SIGKILL)
    await task
    return time.perf_counter() - killed


def bench_recovery(args) -> dict[str, float]:
    """Seconds from killing decode-0 (while it decodes every request) to the last finishing."""
    out: dict[str, list[float]] = {"embedded": [], "ray": []}
    for _ in range(args.repeats):
        for name, placement in (("embedded", "local"), ("ray", "ray")):
            cluster = make(args, placement)
            with cluster as url:
                out[name].append(asyncio.run(load_and_kill(cluster, url, args)))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ray-address", default=None, help="an existing Ray cluster with the pools")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048, help="KV tokens per bandwidth transfer")
    ap.add_argument("--only", nargs="*", default=["startup", "bandwidth", "recovery", "latency"])
    args = ap.parse_args()
    start = time.perf_counter()
    nodes = None
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="WARNING")
    else:
        from ray.cluster_utils import Cluster as RayNodes

        cpus = os.cpu_count()
        nodes = RayNodes(
            initialize_head=True,
            head_node_args={
                "num_cpus": cpus,
                "resources": {"prefill_pool": 100},
                "include_dashboard": False,
            },
        )
        nodes.add_node(num_cpus=cpus, resources={"decode_pool": 100})
        ray.init(address=nodes.address, logging_level="WARNING")
        nodes.wait_for_nodes()
    results: dict = {"ray_cluster_start_s": time.perf_counter() - start}
    print(f"Ray cluster (2 nodes) up in {results['ray_cluster_start_s']:.1f} s")
    try:
        if "startup" in args.only:
            r = results["startup_s"] = bench_startup(args)
            print(f"\n| 1P2D start-up (s) | embedded | Ray |\n|---|---|---|\n"
                  f"| enter to healthy | {r['embedded']:.2f} | {r['ray']:.2f} |")  # fmt: skip
        if "bandwidth" in args.only:
            r = results["bandwidth_gbps"] = bench_bandwidth(args)
            print(f"\n| KV transfer, {args.tokens} tokens | GB/s |\n|---|---|")
            for name, gbps in r.items():
                print(f"| {name} | {gbps:.2f} |")
        if "recovery" in args.only:
            r = results["recovery_s"] = bench_recovery(args)
            print(f"\n| kill decode-0 -> {args.requests} requests done (s) | embedded | Ray |\n"
                  f"|---|---|---|\n| | {r['embedded']:.2f} | {r['ray']:.2f} |")  # fmt: skip
        if "latency" in args.only:
            r = results["latency_ms"] = bench_latency(args)
            print(f"\n| {args.requests} streams, {args.prompt_tokens} -> {args.max_tokens} "
                  f"tokens | TTFT ms | TPOT ms |\n|---|---|---|")  # fmt: skip
            for name, (ttft, tpot) in r.items():
                print(f"| {name} | {ttft:.0f} | {tpot:.1f} |")
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()
    print("JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
