"""Simulator accuracy on this machine: predicted vs measured p50/p90 TTFT and TPOT.

    .venv/bin/python benchmarks/sim_accuracy.py [--profile cpu.json] [--num-requests 60]
        [--measured-dir /tmp/sim_accuracy_XXXX]   # a new profile against a run's measurements

1. `pdserve profile` (unless --profile names one): one profile, threads 1 and all cores.
2. For each workload (chat-like, summarization-like, multi-turn with shared prefixes) it
   runs `pdserve bench compare` on the real deployments (collocated on every core, 1p1d one
   core each, two collocated workers one core each) and `pdserve simulate` on the same
   layouts, same flags, same seed: the same sessions and send times.
3. Prints one row per (workload, deployment, metric): measured, predicted, error.

Needs a quiet machine: the profile and the real runs must see the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
WORKLOADS = {
    "chat": ["--preset", "chat"],
    "summarization": ["--preset", "summarization"],
    "multi-turn": ["--input-len", "lognormal:128:0.5", "--output-len", "lognormal:64:0.5",
                   "--num-turns", "4", "--num-prefix-groups", "4", "--prefix-len", "256"],
}  # fmt: skip
# name -> (bench compare spec, simulate flags)
DEPLOYMENTS = {
    "collocated": ("collocated", ["--deployment", "collocated", "--collocated-size", str(CORES)]),
    "1p1d": ("1p1d", ["--deployment", "1p1d"]),
    "2c": (str(ROOT / "benchmarks/configs/2col-shortest_queue.yaml"),
           ["--deployment", "2c", "--routing", "shortest_queue"]),
}  # fmt: skip
METRICS = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90")]


def pdserve(*argv: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], check=True, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="an existing profile (default: measure one)")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--rates", default="chat=0.3,summarization=0.1,multi-turn=0.3",
                        help="sessions/s per workload")  # fmt: skip
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON with every row")
    parser.add_argument("--measured-dir", help="a former run's directory: compare against its "
                        "measured results instead of running the deployments again")  # fmt: skip
    args = parser.parse_args()
    rates = dict(item.split("=") for item in args.rates.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="sim_accuracy_"))
    profile = args.profile or str(tmp / "profile.json")
    if not args.profile:
        threads = ",".join(str(t) for t in sorted({1, CORES}))
        pdserve("profile", "--threads", threads, "--output", profile)
    rows = []
    for workload in args.workloads.split(","):
        common = [*WORKLOADS[workload], "--rate", rates[workload], "--num-requests",
                  str(args.num_requests), "--seed", str(args.seed), "--slo-ttft-ms", "1e9",
                  "--slo-tpot-ms", "1e9", "--no-progress"]  # fmt: skip
        names = args.deployments.split(",")
        measured_file = Path(args.measured_dir or tmp) / f"{workload}-measured.json"
        specs = [f"--deployment={n}={DEPLOYMENTS[n][0]}" for n in names]
        if not args.measured_dir:
            pdserve("bench", "compare", *common, *specs, "--output", str(measured_file))
        measured = json.loads(measured_file.read_text())["compare"]
        for name in names:
            predicted_file = tmp / f"{workload}-{name}-predicted.json"
            pdserve("simulate", *common, "--profile", profile, *DEPLOYMENTS[name][1],
                    "--output", str(predicted_file))  # fmt: skip
            predicted = json.loads(predicted_file.read_text())["summary"]
            for key, q in METRICS:
                m = measured[name]["summary"][key][q]
                p = predicted[key][q]
                error = (p - m) / m if m else float("nan")
                rows.append({"workload": workload, "deployment": name, "metric": f"{q} {key}",
                             "measured": m, "predicted": p, "error": error})  # fmt: skip
    print(f"{'workload':<15}{'deployment':<12}{'metric':<13}{'measured':>10}{'predicted':>11}"
          f"{'error':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['workload']:<15}{r['deployment']:<12}{r['metric']:<13}{r['measured']:>10.1f}"
              f"{r['predicted']:>11.1f}{r['error']:>9.1%}")  # fmt: skip
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(f"within 15%: {within}/{len(rows)}")
    if args.output:
        Path(args.output).write_text(json.dumps({"profile": profile, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
