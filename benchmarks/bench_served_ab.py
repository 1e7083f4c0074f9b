"""Two checkouts served side by side: batch-1 TPOT, the router's CPU per streamed token, and
output tok/s at 32 concurrent, greedy and at temperature 1.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_served_ab.py --base /path/to/old/checkout

Each round starts a collocated cluster on every core (`pdserve up --collocated 1`) from each
tree in turn (`--base` and `--new`, default this one): its router and worker import that
tree's pdserve. The client is always this tree's `pdserve bench`, in its own process. Runs
from `/`, so `python -m` finds pdserve on PYTHONPATH, not in the working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.config import Pipeline, Role  # noqa: E402
from pdserve.cluster.launcher import Cluster, free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_served import MODEL, run_client  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def measure(tree: str, args: argparse.Namespace) -> dict[str, float]:
    os.environ["PYTHONPATH"] = tree  # what the launcher's router and worker import
    pipeline = Pipeline(model=MODEL, collocated=Role(threads=args.threads), port=free_port())
    length = {"input_len": args.input_len, "output_len": args.output_len}
    row: dict[str, float] = {}
    cluster = Cluster(pipeline, log_level="WARNING")
    with cluster as url:
        router = next(p.popen.pid for p in cluster.processes if p.name == "router")
        run_client(url, num_requests=1, **length)  # warm-up
        before = cpu_s(router)
        s = run_client(url, num_requests=args.requests, max_concurrency=1, **length)
        row["tpot_ms"] = s["tpot_ms"]["p50"]
        tokens = s["num_completed"] * args.output_len
        row["router_cpu_ms_per_token"] = (cpu_s(router) - before) / tokens * 1e3
        for seed, temperature in ((2, 0.0), (3, 1.0)):  # new prompts: no prefix-cache hits
            load = {"num_requests": 2 * args.concurrent, "max_concurrency": args.concurrent}
            s = run_client(url, seed, temperature=temperature, **load, **length)
            row[f"tok_s_{args.concurrent}_t{temperature:g}"] = s["output_tokens_per_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout")
    ap.add_argument("--new", default=str(ROOT))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help="sequential, for batch-1 TPOT")
    ap.add_argument("--concurrent", type=int, default=32)
    args = ap.parse_args()
    os.chdir("/")
    trees = {"base": str(Path(args.base).resolve()), "new": str(Path(args.new).resolve())}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            rows[name].append(measure(tree, args))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    keys = list(rows["new"][0])
    print(f"medians over {args.rounds} rounds; base {trees['base']}, new {trees['new']}")
    print("| tree | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, runs in rows.items():
        print(
            f"| {name} | "
            + " | ".join(f"{statistics.median(run[k] for run in runs):.3g}" for k in keys)
            + " |"
        )
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in keys}
               for name, runs in rows.items()}  # fmt: skip
    ratios = (medians["new"][k] / medians["base"][k] for k in keys)
    print("| new / base | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")


if __name__ == "__main__":
    main()
