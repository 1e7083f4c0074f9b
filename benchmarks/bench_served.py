"""Served speed against the engine's own: batch-1 TPOT, 32-concurrent tok/s, 512-token TTFT.

Each round, for each variant (a set of environment variables given to the worker and to the
offline engine, e.g. the OpenMP wait policy), this script

- runs the engine offline (`LLM.stream` in a fresh process, like `LLM.generate`) on one
  request at a time and takes its TPOT (time between the first and the last token / tokens-1);
- starts a collocated cluster as `pdserve up --collocated 1 --threads T` would and drives it
  with the `pdserve bench` client (a separate process, as in the issue): TPOT at concurrency 1,
  output tok/s at 32 concurrent, TTFT of 512-token prompts.

Variants are interleaved round by round, so load from other processes hits them alike; the
table shows medians over rounds and the served/offline TPOT ratio.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_served.py --rounds 3
    ... --variant spin:OMP_WAIT_POLICY=active --variant passive:OMP_WAIT_POLICY=passive
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.config import Pipeline, Role  # noqa: E402
from pdserve.cluster.launcher import Cluster, free_port  # noqa: E402

MODEL = "smollm2-135m"


def offline_tpot_ms(threads: int, input_len: int, output_len: int, num_requests: int) -> float:
    """Median TPOT of single requests on an in-process engine (run in a child process)."""
    import torch

    from pdserve import LLM, SamplingParams

    llm = LLM(MODEL, threads=threads)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    tpots = []
    for i in range(num_requests + 1):
        prompt = torch.randint(1000, 40000, (input_len,), generator=gen).tolist()
        stamps = [time.perf_counter() for _ in llm.stream([prompt], params)]
        if i:  # the first request warms the kernels up
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000)
    return statistics.median(tpots)


def run_client(url: str, seed: int = 1, **flags) -> dict:
    """One `pdserve bench` run (a separate process, as a real client); its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        args = [sys.executable, "-m", "pdserve.bench", "--url", url, "--model", MODEL,
                "--output", str(out), "--no-progress", "--seed", str(seed)]  # fmt: skip
        for name, value in flags.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, env=child_env({}))
        return json.loads(out.read_text())["summary"]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def served_figures(url: str, args: argparse.Namespace) -> dict[str, float]:
    """TPOT at concurrency 1, output tok/s at `args.concurrent` concurrent, TTFT of
    `args.long_input_len`-token prompts: p50s from `pdserve bench` runs against `url`."""
    row: dict[str, float] = {}
    length = {"input_len": args.input_len, "output_len": args.output_len}
    run_client(url, num_requests=1, **length)  # warm-up
    s = run_client(url, num_requests=args.requests, max_concurrency=1, **length)
    row["served_tpot_ms"] = s["tpot_ms"]["p50"]
    if args.concurrent:
        s = run_client(url, num_requests=2 * args.concurrent,
                       max_concurrency=args.concurrent, **length)  # fmt: skip
        row["tok_s_at_32"] = s["output_tokens_per_s"]
    if args.long_input_len:
        s = run_client(url, num_requests=args.requests, max_concurrency=1,
                       input_len=args.long_input_len, output_len=4)  # fmt: skip
        row["ttft_long_ms"] = s["ttft_ms"]["p50"]
    return row


def measure(variant: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    row: dict[str, float] = {}
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_served; "
            f"print(bench_served.offline_tpot_ms({args.threads}, {args.input_len}, "
            f"{args.output_len}, {args.requests}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=child_env(variant))  # fmt: skip
    row["offline_tpot_ms"] = float(out.stdout.strip().splitlines()[-1])
    pipeline = Pipeline(model=MODEL, collocated=Role(threads=args.threads), port=free_port())
    saved = dict(os.environ)
    os.environ.update(variant)  # the launcher hands its environment to the workers
    try:
        with Cluster(pipeline, log_level="WARNING") as url:
            row.update(served_figures(url, args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    row["served_over_offline"] = row["served_tpot_ms"] / row["offline_tpot_ms"]
    return row


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    env = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, env


def add_served_flags(ap: argparse.ArgumentParser) -> None:
    """The flags `served_figures` and the rounds read (shared with bench_llamacpp.py)."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per figure")
    ap.add_argument("--concurrent", type=int, default=32, help="0: skip the concurrent run")
    ap.add_argument("--long-input-len", type=int, default=512, help="0: skip the TTFT run")
    ap.add_argument("--json", help="write every round's rows here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variant", action="append", default=[],
        help="NAME:VAR=VALUE,VAR=VALUE (repeatable; default: pdserve's defaults)",
    )  # fmt: skip
    add_served_flags(ap)
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variant) or {"default": {}}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, env in variants.items():
            rows[name].append(measure(env, args))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    keys = list(next(iter(rows.values()))[0])
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, runs in rows.items():
        cells = [f"{statistics.median(run[k] for run in runs):.3g}" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
