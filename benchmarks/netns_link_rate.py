"""KV bytes per second over a shaped link between two namespace hosts (pdserve/testing/netns.py),
against the link's rate: one prefill-side sender and one decode-side receiver, each in its
own namespace, the tcp backend (the hosts share no /dev/shm), one whole prompt's KV per send.

    sudo .venv/bin/python benchmarks/netns_link_rate.py --rates none,10gbit,1gbit

The default layout is SmolLM2-135M's fp32 KV for 2,048 tokens (30 layers, 3 KV heads of 64:
90 MiB). Prints, per rate, the median seconds from `send` to the receiver's acknowledgement
over `--repeats` sends and the KV rate achieved. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.testing.netns import Hosts, Link, available  # noqa: E402

SECRET = "b'k' * 32"
RECEIVE = """
import json, sys, time, torch
from pdserve.transfer import make_receiver
from pdserve.transfer.layout import KVLayout
layout = KVLayout(**json.loads(sys.argv[2]))
rx = make_receiver("tcp", torch.zeros(layout.shape), layout, {secret}, host=sys.argv[1])
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
tx = make_sender("tcp", torch.randn(layout.shape), layout, {secret})
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


def measure(hosts: Hosts, rate: str, layout: dict, repeats: int) -> list[float]:
    link = Link(rate=None if rate == "none" else rate)
    for name in hosts.names:
        hosts.shape(name, link)
    spec = json.dumps(layout)
    receive = RECEIVE.format(secret=SECRET)
    receiver = subprocess.Popen(
        [*hosts.prefix_of("decode"), sys.executable, "-c", receive, hosts.ip("decode"), spec,
         str(repeats)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        peer = receiver.stdout.readline()
        sent = subprocess.run(
            [*hosts.prefix_of("prefill"), sys.executable, "-c", SEND.format(secret=SECRET), peer,
             spec, str(repeats)], capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        if sent.returncode:
            raise RuntimeError(sent.stderr[-2000:])
        return json.loads(sent.stdout.strip().splitlines()[-1])
    finally:
        receiver.kill()
        receiver.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,10gbit,1gbit", help="none: unshaped")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if why := available():
        print(f"netns_link_rate: {why}", file=sys.stderr)
        return 2
    layout = {"num_layers": 30, "num_blocks": args.tokens // 16, "block_size": 16,
              "num_kv_heads": 3, "head_dim": 64}  # fmt: skip
    num_bytes = 30 * args.tokens * 3 * 64 * 2 * 4
    rows = []
    with Hosts(["prefill", "decode"], prefix="pdlr") as hosts:
        for rate in args.rates.split(","):
            seconds = sorted(measure(hosts, rate, layout, args.repeats))
            median_s = seconds[len(seconds) // 2]
            rows.append({"rate": rate, "kv_mib": round(num_bytes / 2**20, 1),
                         "median_ms": round(median_s * 1000, 1),
                         "kv_gbit_s": round(num_bytes * 8 / median_s / 1e9, 2),
                         "all_ms": [round(s * 1000, 1) for s in seconds]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
