"""A fault run across hosts: a prefill and a decode worker in network namespaces of their own
(pdserve/testing/netns.py), requests sent while both links drop 1% of packets, the decode
worker's link is cut twice and, optionally, its rate drops tenfold for a while. Every request
must end within its bound with the text of a fault-free run, every KV block must come back, and
the fallbacks must show on /metrics.

    sudo .venv/bin/python benchmarks/netns_faults.py --requests 12 --cuts 6:5,24:5
    sudo .venv/bin/python benchmarks/netns_faults.py --requests 200 --concurrency 8 \
        --interval-s 0.5 --prompt-tokens 128 --max-tokens 8 --cuts 20:5,60:5 --slowdowns 35:10

Prints one JSON document: per request its status, seconds and whether its text matched;
the counts (hung, mismatched, leaked blocks) and the fallback counters. Needs root, iproute2
and nftables (loss). Exit status 1 when a request hung or failed, a block leaked, or the
faults left no count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.router_stats import leaked_blocks, metrics_text, samples  # noqa: E402
from pdserve.bench.router_stats import post_completion as post  # noqa: E402
from pdserve.cluster.config import Pipeline, WorkerGroup  # noqa: E402
from pdserve.cluster.launcher import Cluster, Placement, free_port  # noqa: E402
from pdserve.testing.netns import Hosts, Link, available, bits_per_s  # noqa: E402

COUNTERS = (
    "pdserve_request_redrives_total",
    "pdserve_local_prefill_fallbacks_total",
    "pdserve_kv_transfer_failures_total",
    "pdserve_rejections_retried_total",
    "pdserve_kv_transfer_fallbacks_total",
)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(200, 20000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    bodies = [
        {"model": args.model, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
         "ignore_eos": True} for p in prompts
    ]  # fmt: skip
    one = WorkerGroup(kv_cache_bytes=args.kv_bytes, threads=1)
    pipeline = Pipeline(model=args.model, port=free_port(), prefill=one, decode=one)
    names = ["prefill-0", "decode-0"]
    with Hosts(names, prefix="pdfr") as hosts:
        placed = {"router": Placement(hosts.gateway)}
        placed |= {n: Placement(hosts.ip(n), tuple(hosts.prefix_of(n))) for n in names}
        with Cluster(pipeline, "WARNING", placements=placed) as url:
            started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers = pool.map(lambda b: post(url, b, args.bound_s), bodies)
                reference = [a["choices"][0]["text"] for a in answers]
            reference_s = time.monotonic() - started
            for name in names:
                hosts.shape(name, Link(rate=args.rate, loss_pct=args.loss_pct))
            results: list[dict] = [{} for _ in bodies]
            start = time.monotonic()

            def one_request(i: int) -> None:
                time.sleep(max(0.0, start + i * args.interval_s - time.monotonic()))
                t0 = time.monotonic()
                try:
                    text = post(url, bodies[i], args.bound_s)["choices"][0]["text"]
                    status = "ok"
                except urllib.error.HTTPError as e:
                    text, status = "", f"http {e.code}"
                except OSError as e:  # a timeout past the bound: hung
                    text, status = "", f"error {type(e).__name__}"
                seconds = time.monotonic() - t0
                results[i] = {
                    "status": status,
                    "seconds": round(seconds, 2),
                    "at_s": round(t0 - start, 2),
                    "same_text": text == reference[i],
                }

            cuts = [tuple(map(float, c.split(":"))) for c in args.cuts.split(",") if c]

            def cutter() -> None:
                for at_s, length_s in cuts:
                    time.sleep(max(0.0, start + at_s - time.monotonic()))
                    hosts.set_link("decode-0", up=False)
                    time.sleep(length_s)
                    hosts.set_link("decode-0", up=True)

            slowdowns = [tuple(map(float, c.split(":"))) for c in args.slowdowns.split(",") if c]

            def slower() -> None:  # the decode link's rate divided by 10, then restored
                tenth = f"{bits_per_s(args.rate) // 10}bit"
                for at_s, length_s in slowdowns:
                    time.sleep(max(0.0, start + at_s - time.monotonic()))
                    hosts.set_rate("decode-0", tenth)
                    time.sleep(length_s)
                    hosts.set_rate("decode-0", args.rate)

            links = [threading.Thread(target=cutter), threading.Thread(target=slower)]
            for thread in links:
                thread.start()
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one_request, range(len(bodies))))
            faulted_s = time.monotonic() - start
            for thread in links:
                thread.join()
            loss_by = hosts.loss_by
            for name in names:
                hosts.shape(name, Link())
            leaked = leaked_blocks(url)
            text = metrics_text(url)
    hung = [r for r in results if r["status"] != "ok" and r["status"].startswith("error")]
    seconds = sorted(r["seconds"] for r in results)
    return {
        "requests": results,
        "reference_run_s": round(reference_s, 1),
        "faulted_run_s": round(faulted_s, 1),
        "loss_by": loss_by,
        "num_ok": sum(r["status"] == "ok" for r in results),
        "num_hung": len(hung),
        "num_failed": sum(r["status"].startswith("http") for r in results),
        "num_text_mismatch": sum(r["status"] == "ok" and not r["same_text"] for r in results),
        "p50_seconds": seconds[len(seconds) // 2],
        "p99_seconds": seconds[min(len(seconds) - 1, len(seconds) * 99 // 100)],
        "max_seconds": seconds[-1],
        "leaked_blocks": leaked,
        "counters": {name: samples(text, name) for name in COUNTERS},
        "setup": {k: v for k, v in vars(args).items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--interval-s", type=float, default=2.5, help="between request starts")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--kv-bytes", type=int, default=128 * 2**20)
    parser.add_argument("--rate", default="1gbit", help="each link, each way")
    parser.add_argument("--loss-pct", type=float, default=1.0, help="each link, each way")
    parser.add_argument("--cuts", default="6:5,24:5", help="at_s:length_s of decode link cuts")
    parser.add_argument(
        "--slowdowns", default="", help="at_s:length_s of the decode link at a tenth of --rate"
    )
    parser.add_argument("--bound-s", type=float, default=120.0, help="a request's end bound")
    args = parser.parse_args()
    if why := available():
        print(f"netns_faults: {why}", file=sys.stderr)
        return 2
    report = run(args)
    print(json.dumps(report, indent=1))
    counted = any(report["counters"][n] for n in COUNTERS[:3])
    bad = report["num_hung"] or report["num_failed"] or report["leaked_blocks"] or not counted
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
