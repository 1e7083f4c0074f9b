"""A prefill and a decode host in network namespaces, the router in the root namespace, a shaped
link between them; needs root and iproute2, nftables for loss (docs/cluster.md, "Hosts as
network namespaces", says what `link-rate` and `faults` measure and check).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pdserve.bench.metrics import latency_stats_ms
from pdserve.bench.router_stats import leaked_blocks, metrics_text, post_completion, samples
from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, Placement, free_port
from pdserve.testing.netns import Hosts, Link, available, bits_per_s
from pdserve.transfer import KVTransferConfig

PREFILL, DECODE = "prefill-0", "decode-0"  # the cluster's worker names, and the hosts'
COUNTERS = (
    "pdserve_request_redrives_total",
    "pdserve_local_prefill_fallbacks_total",
    "pdserve_kv_transfer_failures_total",
    "pdserve_rejections_retried_total",
    "pdserve_kv_transfer_fallbacks_total",
)
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


def cluster(hosts: Hosts, model: str, worker: WorkerGroup, backend: str = "tcp") -> Cluster:
    """A 1P1D cluster with each worker on its host and the router on the bridge."""
    pipeline = Pipeline(
        model=model,
        port=free_port(),
        prefill=worker,
        decode=worker,
        kv_transfer=KVTransferConfig(backend=backend),
    )
    placed = {"router": Placement(hosts.gateway)}
    placed |= {n: Placement(hosts.ip(n), tuple(hosts.prefix_of(n))) for n in hosts.names}
    return Cluster(pipeline, "WARNING", placements=placed)


def shape_all(hosts: Hosts, link: Link) -> None:
    for name in hosts.names:
        hosts.shape(name, link)


def measure(hosts: Hosts, layout: dict, repeats: int, backend: str) -> list[float]:
    """Seconds of `repeats` bare sends of one prompt's KV, prefill host to decode host."""
    argv = [json.dumps(layout), str(repeats), backend]
    code = RECEIVE.format(secret=SECRET)
    rx_cmd = [*hosts.prefix_of(DECODE), sys.executable, "-c", code, hosts.ip(DECODE), *argv]
    receiver = subprocess.Popen(rx_cmd, stdout=subprocess.PIPE, text=True)
    try:
        peer, code = receiver.stdout.readline(), SEND.format(secret=SECRET)
        tx_cmd = [*hosts.prefix_of(PREFILL), sys.executable, "-c", code, peer, *argv]
        sent = subprocess.run(tx_cmd, capture_output=True, text=True, timeout=300)
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


def greedy(model: str, rng: random.Random, tokens: int, max_tokens: int) -> dict:
    """A greedy completion's body: a random prompt of `tokens`, `max_tokens` generated."""
    prompt = [rng.randrange(200, 20000) for _ in range(tokens)]
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def served(url: str, model: str, tokens: int, repeats: int, rng: random.Random) -> dict:
    """`repeats` distinct prompts of `tokens` (no prefix hit), one at a time: the medians of
    their prefill and exposed transfer, the KV bytes each sent, and the link's rate as the
    prefill worker's sender measured it (what the adaptive planner prices)."""
    parts, (bytes_before, send_s_before) = [], kv_sent(url)
    for _ in range(repeats):
        body = greedy(model, rng, tokens, 2)
        parts.append(post_completion(url, body, 600, timing=True)["pdserve_timing"]["ttft_parts_s"])
    bytes_after, send_s_after = kv_sent(url)
    num_bytes = (bytes_after - bytes_before) / repeats
    sender_bps = 8 * (bytes_after - bytes_before) / max(1e-9, send_s_after - send_s_before)
    median = {k: sorted(p[k] for p in parts)[repeats // 2] for k in ("prefill", "transfer")}
    return {"num_bytes": num_bytes, "sender_bps": sender_bps, **median}


def link_rate(hosts: Hosts, args: argparse.Namespace) -> int:
    layout = dict(
        num_layers=30, num_blocks=args.tokens // 16, block_size=16, num_kv_heads=3, head_dim=64
    )
    num_bytes = 30 * args.tokens * 3 * 64 * 2 * 4
    rows = []
    for rate, backend in itertools.product(args.rates.split(","), args.transfer.split(",")):
        shape_all(hosts, Link(rate=None if rate == "none" else rate))
        seconds = sorted(measure(hosts, layout, args.repeats, backend))
        median_s = seconds[len(seconds) // 2]
        rows.append(
            {
                "rate": rate,
                "transfer": backend,
                "kv_mib": round(num_bytes / 2**20, 1),
                "median_ms": round(median_s * 1000, 1),
                "kv_gbit_s": round(num_bytes * 8 / median_s / 1e9, 2),
                "all_ms": [round(s * 1000, 1) for s in seconds],
            }
        )
        if rate != "none":
            rows[-1]["of_link"] = round(rows[-1]["kv_gbit_s"] * 1e9 / bits_per_s(rate), 2)
        print(json.dumps(rows[-1]), flush=True)
    for backend in args.transfer.split(",") if args.served else []:
        served_backend(hosts, [r for r in rows if r["transfer"] == backend], args, backend)
    return 0


def served_backend(hosts: Hosts, rows: list[dict], args: argparse.Namespace, backend: str) -> None:
    """The rates of `rows` through a prefill and a decode worker in the two namespaces (the
    first prompt of each rate warms the link up and is left out)."""
    rng, worker = random.Random(0), WorkerGroup(kv_cache_bytes=256 * 2**20, threads=args.threads)
    with cluster(hosts, args.model, worker, backend) as url:
        for row in rows:
            shape_all(hosts, Link(rate=None if row["rate"] == "none" else row["rate"]))
            served(url, args.model, args.tokens, 1, rng)
            got = served(url, args.model, args.tokens, args.repeats, rng)
            wire_s = got["num_bytes"] * 8 / (row["kv_gbit_s"] * 1e9)
            out = {
                "rate": row["rate"],
                "transfer": backend,
                "served_kv_mib": round(got["num_bytes"] / 2**20, 1),
                "prefill_ms": round(got["prefill"] * 1000, 1),
                "wire_ms": round(wire_s * 1000, 1),
                "exposed_ms": round(got["transfer"] * 1000, 1),
                "sender_gbit_s": round(got["sender_bps"] / 1e9, 2),
                "hidden": round(max(0.0, 1 - got["transfer"] / wire_s), 3),
            }
            print(json.dumps(out), flush=True)


def spans(text: str) -> list[tuple[float, float]]:
    """'6:5,24:5' -> [(6.0, 5.0), (24.0, 5.0)]: (at_s, length_s) each."""
    return [tuple(map(float, c.split(":"))) for c in text.split(",") if c]


def at_times(start: float, when: list[tuple[float, float]], on, off) -> threading.Thread:
    """A thread that calls `on()` at each span's start (s after `start`) and `off()` at its end."""

    def run() -> None:
        for at_s, length_s in when:
            time.sleep(max(0.0, start + at_s - time.monotonic()))
            on()
            time.sleep(length_s)
            off()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def send_all(url: str, bodies: list[dict], reference: list[str], args) -> list[dict]:
    """Each body sent `--interval-s` after the one before (at most `--concurrency` at once):
    its status, seconds, start and whether its text is the reference's."""
    start, results = time.monotonic(), [{} for _ in bodies]

    def one(i: int) -> None:
        time.sleep(max(0.0, start + i * args.interval_s - time.monotonic()))
        t0, text = time.monotonic(), ""
        try:
            text, status = post_completion(url, bodies[i], args.bound_s)["choices"][0]["text"], "ok"
        except urllib.error.HTTPError as e:
            status = f"http {e.code}"
        except OSError as e:  # a timeout past the bound: hung
            status = f"error {type(e).__name__}"
        results[i] = {
            "status": status,
            "seconds": round(time.monotonic() - t0, 2),
            "at_s": round(t0 - start, 2),
            "same_text": text == reference[i],
        }

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(len(bodies))))
    return results


def faults(hosts: Hosts, args: argparse.Namespace) -> int:
    rng = random.Random(0)
    bodies = [
        greedy(args.model, rng, args.prompt_tokens, args.max_tokens) for _ in range(args.requests)
    ]
    with cluster(hosts, args.model, WorkerGroup(kv_cache_bytes=args.kv_bytes, threads=1)) as url:
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = pool.map(lambda b: post_completion(url, b, args.bound_s), bodies)
            reference = [a["choices"][0]["text"] for a in answers]
        shape_all(hosts, Link(rate=args.rate, loss_pct=args.loss_pct))
        start, tenth = time.monotonic(), f"{bits_per_s(args.rate) // 10}bit"
        cut, slow = spans(args.cuts), spans(args.slowdowns)
        links = [
            at_times(
                start,
                cut,
                lambda: hosts.set_link(DECODE, up=False),
                lambda: hosts.set_link(DECODE, up=True),
            ),
            at_times(
                start,
                slow,
                lambda: hosts.set_rate(DECODE, tenth),
                lambda: hosts.set_rate(DECODE, args.rate),
            ),
        ]
        results = send_all(url, bodies, reference, args)
        faulted_s = time.monotonic() - start
        for thread in links:
            thread.join()
        loss_by = hosts.loss_by
        shape_all(hosts, Link())
        leaked, text = leaked_blocks(url), metrics_text(url)
    statuses = [r["status"] for r in results]
    report = {
        "requests": results,
        "faulted_run_s": round(faulted_s, 1),
        "loss_by": loss_by,
        "num_ok": statuses.count("ok"),
        "num_hung": sum(s.startswith("error") for s in statuses),
        "num_failed": sum(s.startswith("http") for s in statuses),
        "num_text_mismatch": sum(r["status"] == "ok" and not r["same_text"] for r in results),
        "request_ms": latency_stats_ms(r["seconds"] for r in results),
        "max_s": max(r["seconds"] for r in results),
        "leaked_blocks": leaked,
        "counters": {name: samples(text, name) for name in COUNTERS},
        "setup": vars(args),
    }
    print(json.dumps(report, indent=1, default=str))
    counted = any(report["counters"][n] for n in COUNTERS[:3])
    return 1 if report["num_hung"] or report["num_failed"] or leaked or not counted else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    sub = parser.add_subparsers(dest="mode", required=True)
    rate = sub.add_parser("link-rate", help="KV bytes/s over a shaped link, bare and served")
    rate.add_argument("--rates", default="none,10gbit,1gbit", help="none: unshaped")
    rate.add_argument("--tokens", type=int, default=2048)
    rate.add_argument("--repeats", type=int, default=5)
    rate.add_argument("--transfer", default="tcp", help="backends, e.g. tcp,mooncake")
    rate.add_argument("--served", action="store_true", help="also through a 1P1D cluster")
    rate.add_argument("--threads", type=int, default=1, help="each worker's (--served)")
    fault = sub.add_parser("faults", help="requests under loss, cuts and slowdowns")
    fault.add_argument("--requests", type=int, default=12)
    fault.add_argument("--concurrency", type=int, default=3)
    fault.add_argument("--interval-s", type=float, default=2.5, help="between request starts")
    fault.add_argument("--prompt-tokens", type=int, default=512)
    fault.add_argument("--max-tokens", type=int, default=24)
    fault.add_argument("--kv-bytes", type=int, default=128 * 2**20)
    fault.add_argument("--rate", default="1gbit", help="each link, each way")
    fault.add_argument("--loss-pct", type=float, default=1.0, help="each link, each way")
    fault.add_argument("--cuts", default="6:5,24:5", help="at_s:length_s of decode link cuts")
    fault.add_argument("--slowdowns", default="", help="at_s:length_s at a tenth of --rate")
    fault.add_argument("--bound-s", type=float, default=120.0, help="a request's end bound")
    args = parser.parse_args()
    if why := available():
        print(f"netns.py: {why}", file=sys.stderr)
        return 2
    with Hosts([PREFILL, DECODE], prefix="pdnb") as hosts:
        return (link_rate if args.mode == "link-rate" else faults)(hosts, args)


if __name__ == "__main__":
    sys.exit(main())
