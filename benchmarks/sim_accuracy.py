"""The simulator against measurements (docs/simulator.md, "Accuracy", says what each mode runs):
`served` (the default) sets `pdserve simulate` beside `pdserve bench compare` per workload and
deployment; `trace-replay` times `pdserve simulate` over a one-hour, 12,000-request trace.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
WORKLOADS = {
    "chat": ["--preset", "chat"],
    "summarization": ["--preset", "summarization"],
    "multi-turn": "--input-len lognormal:128:0.5 --output-len lognormal:64:0.5 --num-turns 4 "
    "--num-prefix-groups 4 --prefix-len 256".split(),
}
# name -> (bench compare spec, simulate flags)
DEPLOYMENTS = {
    "collocated": ("collocated", ["--deployment", "collocated", "--collocated-size", str(CORES)]),
    "1p1d": ("1p1d", ["--deployment", "1p1d"]),
    "2c": (
        str(ROOT / "benchmarks/configs/2col-shortest_queue.yaml"),
        ["--deployment", "2c", "--routing", "shortest_queue"],
    ),
}
METRICS = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90")]
TRACE_REPLAY = (
    "--profile analytic:H100-SXM:llama-3-8b --deployment 4p4d --max-num-seqs 256 --routing "
    "prefix_cache --max-num-batched-tokens 8192 --max-model-len 131072 --slo-ttft-ms 2000 "
    "--slo-tpot-ms 100 --no-progress"
).split()
TRACE_SECONDS, TRACE_INPUT, TRACE_OUTPUT = 3600.0, 2000.0, 300.0  # new tokens a turn (means)


def pdserve(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], check=True)


def simulate(common: list[str], profile: Path, name: str, output: Path) -> dict:
    pdserve(
        "simulate",
        *common,
        "--profile",
        str(profile),
        *DEPLOYMENTS[name][1],
        "--output",
        str(output),
    )
    return json.loads(output.read_text())


def capacity(common: list[str], profile: Path, names: list[str], tmp: Path) -> float:
    """Sessions/s the slowest of `names` serves, as `profile` predicts: all sent at once."""
    rates = []
    for name in names:
        result = simulate([*common, "--rate", "inf"], profile, name, tmp / "capacity.json")
        sessions = len({r["session_id"] for r in result["records"]})
        rates.append(sessions / result["summary"]["duration_s"])
    return min(rates)


def mean_probe(base: Path, probes: list[Path], output: Path) -> Path:
    """`base` rescaled by the mean of the ratios the `probes` (rescaled copies of it) hold."""
    from pdserve.costmodel.profile import load_profile
    from pdserve.perf.rescale import rescaled

    ratios = [json.loads(p.read_text())["machine"]["rescaled"]["ratios"] for p in probes]
    mean = {int(k): sum(r[k] for r in ratios) / len(ratios) for k in ratios[0]}
    rescaled(load_profile(base), mean).save(output)
    return output


def synthetic_trace(path: Path, num_requests: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    times_ms = np.cumsum(rng.exponential(TRACE_SECONDS / num_requests, num_requests)) * 1000
    next_hash, sessions, lines = 0, [], []  # sessions: hash ids so far, per open conversation
    for t in times_ms:
        new_len = int(max(16, rng.lognormal(math.log(TRACE_INPUT) - 0.5, 1.0)))
        if sessions and rng.random() < 0.5:  # a later turn of an open conversation
            index = int(rng.integers(len(sessions)))
            history = sessions[index]
        else:
            history, index = [], len(sessions)
            sessions.append(history)
        num_new = math.ceil(new_len / 512)
        hash_ids = history + list(range(next_hash, next_hash + num_new))
        next_hash += num_new
        sessions[index] = hash_ids
        output = int(max(1, rng.lognormal(math.log(TRACE_OUTPUT) - 0.32, 0.8)))
        lines.append(
            {
                "timestamp": int(t),
                "input_length": 512 * len(history) + new_len,
                "output_length": output,
                "hash_ids": hash_ids,
            }
        )
        if len(sessions) > 2000:
            sessions.pop(0)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def trace_replay(trace: str | None, num_requests: int, seed: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(trace or Path(tmp) / "trace.jsonl")
        if not trace:
            synthetic_trace(path, num_requests, seed)
        start = time.perf_counter()
        pdserve(
            "simulate", "--trace", str(path), "--num-requests", str(num_requests), *TRACE_REPLAY
        )
        print(f"{'wall time incl. start-up (s)':<40}{time.perf_counter() - start:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("served", "trace-replay"), default="served")
    parser.add_argument("--profile", help="an existing profile (default: measure one)")
    parser.add_argument("--num-requests", type=int, help="served 60, trace-replay 12000")
    parser.add_argument("--trace", help="trace-replay: a Mooncake-format JSONL (default: made)")
    parser.add_argument("--load", type=float, default=0.5, help="of the slowest's capacity")
    parser.add_argument(
        "--rates", help="sessions/s instead of --load, e.g. chat=0.3,multi-turn=0.3"
    )
    parser.add_argument("--no-rescale", action="store_true", help="no speed probes")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON with every row")
    args = parser.parse_args()
    if args.mode == "trace-replay":
        return trace_replay(args.trace, args.num_requests or 12000, args.seed)
    args.num_requests = args.num_requests or 60
    return served(args)


def served(args: argparse.Namespace) -> int:
    rates = dict(item.split("=") for item in args.rates.split(",")) if args.rates else {}
    tmp = Path(tempfile.mkdtemp(prefix="sim_accuracy_"))
    profile = Path(args.profile or tmp / "profile.json")
    if not args.profile:
        threads = ",".join(str(t) for t in sorted({1, CORES}))
        pdserve("profile", "--threads", threads, "--output", str(profile))
    names = args.deployments.split(",")
    probing = not args.no_rescale
    rows = []
    for workload in args.workloads.split(","):
        common = [*WORKLOADS[workload], "--num-requests", str(args.num_requests), "--seed"]
        common += [str(args.seed), "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--no-progress"]
        probes = [tmp / f"{workload}-probe{i}.json" for i in range(len(names) + 1)]
        if probing:
            pdserve("profile", "--rescale", str(profile), "--output", str(probes[0]))
        if workload not in rates:
            first = profile if args.no_rescale else probes[0]
            rates[workload] = f"{args.load * capacity(common, first, names, tmp):.4g}"
            print(f"{workload}: rate {rates[workload]} sessions/s", flush=True)
        common += ["--rate", rates[workload]]
        for i, name in enumerate(names):
            measured_file = tmp / f"{workload}-{name}-measured.json"
            spec = f"--deployment={name}={DEPLOYMENTS[name][0]}"
            pdserve("bench", "compare", *common, spec, "--output", str(measured_file))
            if probing:
                pdserve("profile", "--rescale", str(profile), "--output", str(probes[i + 1]))
            measured = json.loads(measured_file.read_text())["compare"][name]["summary"]
            raw = simulate(common, profile, name, tmp / f"{workload}-{name}-profile.json")
            predicted = raw
            if probing:
                near = mean_probe(profile, probes[i : i + 2], tmp / f"{workload}-{name}-probe.json")
                predicted = simulate(common, near, name, tmp / f"{workload}-{name}-predicted.json")
            for key, q in METRICS:
                m = measured[key][q]
                p, r = predicted["summary"][key][q], raw["summary"][key][q]
                row = {"workload": workload, "deployment": name, "metric": f"{q} {key}"}
                row |= {"rate": float(rates[workload]), "measured": m, "predicted": p}
                rows.append(
                    row
                    | {"error": (p - m) / m, "predicted_profile": r, "error_profile": (r - m) / m}
                )
                print(json.dumps(rows[-1]), flush=True)
    for key, label in (("error", "probed"), ("error_profile", "profile as measured")):
        print(f"within 15%, {label}: {sum(abs(r[key]) <= 0.15 for r in rows)}/{len(rows)}")
    if args.output:
        Path(args.output).write_text(json.dumps({"profile": str(profile), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
