"""How fast `pdserve simulate` replays a one-hour, 12,000-request trace at full length.

    .venv/bin/python benchmarks/sim_trace_replay.py [--trace conversation_trace.jsonl]

`--trace` replays a file as it is (the public Mooncake conversation trace has this size);
without it a Mooncake-format trace is generated (turns extending the previous turn's hash ids,
Poisson arrivals, lognormal lengths): its size, not the real trace's statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_trace(path: Path, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(args.duration_s / args.num_requests, args.num_requests)
    times_ms = np.cumsum(gaps) * 1000
    next_hash = 0
    sessions: list[list[int]] = []  # hash ids so far, per open conversation
    lines = []
    for t in times_ms:
        new_len = int(max(16, rng.lognormal(math.log(args.input_mean) - 0.5, 1.0)))
        if sessions and rng.random() < args.follow_up:
            index = int(rng.integers(len(sessions)))
            history = sessions[index]
        else:
            history, index = [], len(sessions)
            sessions.append(history)
        num_new = math.ceil(new_len / 512)
        hash_ids = history + list(range(next_hash, next_hash + num_new))
        next_hash += num_new
        sessions[index] = hash_ids
        output = int(max(1, rng.lognormal(math.log(args.output_mean) - 0.32, 0.8)))
        lines.append({"timestamp": int(t), "input_length": 512 * len(history) + new_len,
                      "output_length": output, "hash_ids": hash_ids})  # fmt: skip
        if len(sessions) > 2000:
            sessions.pop(0)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a Mooncake-format JSONL trace (default: generate one)")
    parser.add_argument("--num-requests", type=int, default=12000)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--input-mean", type=float, default=2000.0, help="new tokens per turn")
    parser.add_argument("--output-mean", type=float, default=300.0)
    parser.add_argument("--follow-up", type=float, default=0.5, help="share of later turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="analytic:H100-SXM:llama-3-8b")
    parser.add_argument("--deployment", default="4p4d")
    parser.add_argument("--max-model-len", type=int, default=131072)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "trace.jsonl"
        if not args.trace:
            synthetic_trace(trace, args)
        command = [
            sys.executable, "-m", "pdserve.cli", "simulate", "--profile", args.profile,
            "--trace", str(trace), "--num-requests", str(args.num_requests),
            "--deployment", args.deployment, "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192", "--max-model-len", str(args.max_model_len),
            "--routing", "prefix_cache", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
            "--no-progress",
        ]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(command, check=True)
        print(f"{'wall time incl. start-up (s)':<40}{time.perf_counter() - start:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
