"""KV bytes per second over a shaped link between two namespace hosts (pdserve/testing/netns.py),
against the link's rate: one prefill-side sender and one decode-side receiver, each in its
own namespace, one whole prompt's KV per send, over each backend of `--transfer` (tcp by
default: the hosts share no /dev/shm; mooncake: Mooncake's engine moves the bytes).

    sudo .venv/bin/python benchmarks/netns_link_rate.py --rates none,10gbit,1gbit
    sudo .venv/bin/python benchmarks/netns_link_rate.py --rates 1gbit --transfer tcp,mooncake
    sudo .venv/bin/python benchmarks/netns_link_rate.py --rates 25gbit,10gbit,1gbit --served

The default layout is SmolLM2-135M's fp32 KV for 2,048 tokens (30 layers, 3 KV heads of 64:
90 MiB). Prints, per rate, the median seconds from `send` to the receiver's acknowledgement
over `--repeats` sends and the KV rate achieved. With `--served`, also the real thing: a
prefill and a decode worker of the default model (pdserve/cluster) in the same two
namespaces, `--repeats` prompts of `--tokens` each, and per rate the median of the exposed
transfer (the TTFT breakdown's `transfer`: the prefill's last layer to the KV landing on the
decode worker) and the fraction of the link's transfer time hidden behind the prefill:
1 - exposed / (the request's KV bytes at the rate the bare sender achieved). The link has no
delay: this kernel has no sch_netem (see pdserve/testing/netns.py). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.router_stats import post_completion  # noqa: E402
from pdserve.cluster.config import Pipeline, WorkerGroup  # noqa: E402
from pdserve.cluster.launcher import Cluster, Placement, free_port  # noqa: E402
from pdserve.testing.netns import Hosts, Link, available, bits_per_s  # noqa: E402
from pdserve.transfer import KVTransferConfig  # noqa: E402

PREFILL, DECODE = "prefill-0", "decode-0"  # the cluster's worker names, and the hosts'

SECRET = "b'k' * 32"
RECEIVE = """
import json, sys, time, torch
from pdserve.transfer import make_receiver
from pdserve.transfer.layout import KVLayout
layout = KVLayout(**json.loads(sys.argv[2]))
rx = make_receiver(sys.argv[4], torch.zeros(layout.shape), layout, {secret}, host=sys.argv[1])
for i in range(int(sys.argv[3])):
    rx.expect(f"r{{i}}", list(range(layout.num_blocks)))
print(json.dumps(rx.address()), flush=True)
time.sleep(600)
"""
SEND = """
import json, sys, time, torch
from pdserve.transfer import make_sender
from pdserve.transfer.layout import KVLayout
layout = KVLayout(**json.loads(sys.argv[2]))
peer, seconds = json.loads(sys.argv[1]), []
tx = make_sender(sys.argv[4], torch.randn(layout.shape), layout, {secret})
ids, layers = list(range(layout.num_blocks)), list(range(layout.num_layers))
for i in range(int(sys.argv[3])):
    start = time.perf_counter()
    tx.send(peer, f"r{{i}}", layers, ids, ids, last=True)
    while not (finished := tx.pop_finished()):
        time.sleep(0.0005)
    assert finished[0][1].value == "done", finished
    seconds.append(time.perf_counter() - start)
print(json.dumps(seconds))
"""


def measure(hosts: Hosts, rate: str, layout: dict, repeats: int, backend: str) -> list[float]:
    link = Link(rate=None if rate == "none" else rate)
    for name in hosts.names:
        hosts.shape(name, link)
    spec = json.dumps(layout)
    receive = RECEIVE.format(secret=SECRET)
    receiver = subprocess.Popen(
        [*hosts.prefix_of(DECODE), sys.executable, "-c", receive, hosts.ip(DECODE), spec,
         str(repeats), backend], stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        peer = receiver.stdout.readline()
        sent = subprocess.run(
            [*hosts.prefix_of(PREFILL), sys.executable, "-c", SEND.format(secret=SECRET), peer,
             spec, str(repeats), backend], capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        if sent.returncode:
            raise RuntimeError(sent.stderr[-2000:])
        return json.loads(sent.stdout.strip().splitlines()[-1])
    finally:
        receiver.kill()
        receiver.wait()


def kv_sent(url: str) -> tuple[float, float]:
    """The prefill worker's KV bytes sent and its sender's seconds writing them (its last
    Stats, at most a heartbeat old: callers wait one out first)."""
    time.sleep(1.0)  # two heartbeats
    with urllib.request.urlopen(url + "/v1/status", timeout=10) as resp:
        rows = json.loads(resp.read())["workers"]
    row = next(w for w in rows if w["worker"] == PREFILL)
    return float(row["kv_bytes_sent"]), float(row["kv_send_s"])


def served(url: str, model: str, tokens: int, repeats: int, rng: random.Random) -> dict:
    """`repeats` distinct prompts of `tokens` (no prefix hit), one at a time: the medians of
    their prefill and exposed transfer, the KV bytes each sent, and the link's rate as the
    prefill worker's sender measured it (what the adaptive planner prices)."""
    parts, (bytes_before, send_s_before) = [], kv_sent(url)
    for _ in range(repeats):
        prompt = [rng.randrange(200, 20000) for _ in range(tokens)]
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        parts.append(post_completion(url, body, 600, timing=True)["pdserve_timing"]["ttft_parts_s"])
    bytes_after, send_s_after = kv_sent(url)
    num_bytes = (bytes_after - bytes_before) / repeats
    sender_bps = 8 * (bytes_after - bytes_before) / max(1e-9, send_s_after - send_s_before)
    median = {k: sorted(p[k] for p in parts)[repeats // 2] for k in ("prefill", "transfer")}
    return {"num_bytes": num_bytes, "sender_bps": sender_bps, **median}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,10gbit,1gbit", help="none: unshaped")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transfer", default="tcp", help="backends, e.g. tcp,mooncake")
    parser.add_argument("--served", action="store_true", help="also through a 1P1D cluster")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="each worker's (--served)")
    args = parser.parse_args()
    if why := available():
        print(f"netns_link_rate: {why}", file=sys.stderr)
        return 2
    layout = {"num_layers": 30, "num_blocks": args.tokens // 16, "block_size": 16,
              "num_kv_heads": 3, "head_dim": 64}  # fmt: skip
    num_bytes = 30 * args.tokens * 3 * 64 * 2 * 4
    rows = []
    with Hosts([PREFILL, DECODE], prefix="pdlr") as hosts:
        for rate, backend in itertools.product(args.rates.split(","), args.transfer.split(",")):
            seconds = sorted(measure(hosts, rate, layout, args.repeats, backend))
            median_s = seconds[len(seconds) // 2]
            rows.append({"rate": rate, "transfer": backend, "kv_mib": round(num_bytes / 2**20, 1),
                         "median_ms": round(median_s * 1000, 1),
                         "kv_gbit_s": round(num_bytes * 8 / median_s / 1e9, 2),
                         "all_ms": [round(s * 1000, 1) for s in seconds]})  # fmt: skip
            if rate != "none":
                rows[-1]["of_link"] = round(rows[-1]["kv_gbit_s"] * 1e9 / bits_per_s(rate), 2)
            print(json.dumps(rows[-1]), flush=True)
        if args.served:
            served_rows(hosts, rows, args)
    return 0


def served_rows(hosts: Hosts, rows: list[dict], args: argparse.Namespace) -> None:
    """The same rates through a prefill and a decode worker in the two namespaces (the first
    prompt of each rate warms the link up and is left out)."""
    for backend in args.transfer.split(","):
        served_backend(hosts, [r for r in rows if r["transfer"] == backend], args, backend)


def served_backend(hosts: Hosts, rows: list[dict], args: argparse.Namespace, backend: str) -> None:
    one = WorkerGroup(kv_cache_bytes=256 * 2**20, threads=args.threads)
    pipeline = Pipeline(model=args.model, port=free_port(), prefill=one, decode=one,
                        kv_transfer=KVTransferConfig(backend=backend))  # fmt: skip
    placed = {"router": Placement(hosts.gateway)}
    placed |= {n: Placement(hosts.ip(n), tuple(hosts.prefix_of(n))) for n in hosts.names}
    rng = random.Random(0)
    with Cluster(pipeline, "WARNING", placements=placed) as url:
        for row in rows:
            link = Link(rate=None if row["rate"] == "none" else row["rate"])
            for name in hosts.names:
                hosts.shape(name, link)
            served(url, args.model, args.tokens, 1, rng)
            got = served(url, args.model, args.tokens, args.repeats, rng)
            wire_s = got["num_bytes"] * 8 / (row["kv_gbit_s"] * 1e9)
            out = {"rate": row["rate"], "transfer": backend,
                   "served_kv_mib": round(got["num_bytes"] / 2**20, 1),
                   "prefill_ms": round(got["prefill"] * 1000, 1),
                   "wire_ms": round(wire_s * 1000, 1),
                   "exposed_ms": round(got["transfer"] * 1000, 1),
                   "sender_gbit_s": round(got["sender_bps"] / 1e9, 2),
                   "hidden": round(max(0.0, 1 - got["transfer"] / wire_s), 3)}  # fmt: skip
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
