"""Time `sample()` (pdserve/model/sampler.py): temperature 1, no top-k/top-p, SmolLM2's
vocabulary, batches of 1 to 32, one and two threads; the median of `--calls` calls, each on
fresh logits (sampling overwrites them).

    .venv/bin/python benchmarks/bench_sampler.py [--tree PATH]

`--tree` times another checkout's sampler instead (e.g. a worktree of an older commit), in
the same process setup, so two trees can be compared side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose sampler is timed")
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", type=int, default=21)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from pdserve.model.sampler import SamplingRow, sample

    generator = torch.Generator().manual_seed(0)
    print(f"tree {args.tree}; median ms of {args.calls} calls")
    print("| threads | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---" * (len(args.batches) + 1) + "|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        cells = []
        for batch in args.batches:
            logits = torch.randn(batch, args.vocab, generator=generator)
            rows = [SamplingRow(1.0, 0, 1.0, None, 0)] * batch
            times = []
            for _ in range(args.calls):
                fresh = logits.clone()
                start = time.perf_counter()
                sample(fresh, rows, generator)
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:.2f}")
        print(f"| {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
