"""The simulator against measurements: this machine's, a paper's, and a trace's wall time.

    .venv/bin/python benchmarks/sim_accuracy.py [--profile cpu.json] [--num-requests 30]
        [--load 0.5 | --rates chat=0.3,...] [--no-rescale]
    .venv/bin/python benchmarks/sim_accuracy.py --mode published
    .venv/bin/python benchmarks/sim_accuracy.py --mode trace-replay [--trace FILE.jsonl]

`served` (the default): predicted against measured p50/p90 TTFT and TPOT. `pdserve profile`
(unless `--profile`), then per workload (chat, summarization, multi-turn) and deployment
(collocated on every core, 1p1d and two collocated workers one core each): `pdserve bench
compare` on the real deployment and `pdserve simulate` with the same flags and seed (the same
sessions and send times). A speed probe (`pdserve profile --rescale`) runs around each
deployment; each is simulated with the profile rescaled by the mean of the probes on either
side ("probed") and as measured. The rate is `--load` x the capacity the profile predicts for
the slowest deployment.
Needs a quiet machine (docs/simulator.md, "Accuracy").

`published`: DistServe (OSDI'24), Figure 1: OPT-13B on one A100-80GB, Poisson arrivals, input
512 / output 64, SLOs P90 TTFT 0.4 s and P90 TPOT 0.04 s. The paper (and its authors' blog
post, "Throughput is Not All You Need", Hao AI Lab, March 2024) gives collocated ~2.3 req/s
against the TTFT target and ~1.6 against TPOT, a prefill-only GPU ~5.6, a decode-only GPU ~10,
so 2P1D 3.3 req/s per GPU (2.1x); predicted with the analytic A100-80GB profile, pdserve's
scheduler and the same SLO rule, beside the paper's.

`trace-replay`: how fast `pdserve simulate` replays a one-hour, 12,000-request trace at full
length (llama-3-8b on H100-SXM, 4p4d). `--trace` replays a file as it is (the public Mooncake
conversation trace has this size); without it a Mooncake-format trace is generated (turns
extending the previous turn's hash ids, Poisson arrivals, lognormal lengths): its size, not
the real trace's statistics.
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
PAPER = {"collocated": 1.6, "coll. TTFT": 2.3, "coll. TPOT": 1.6, "prefill-only": 5.6,
         "decode-only": 10.0, "2p1d": 10.0}  # fmt: skip
TRACE_SECONDS, TRACE_INPUT, TRACE_OUTPUT = 3600.0, 2000.0, 300.0  # new tokens a turn (means)


def pdserve(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], check=True)


def simulate(common: list[str], profile: Path, name: str, output: Path) -> dict:
    pdserve("simulate", *common, "--profile", str(profile), *DEPLOYMENTS[name][1],
            "--output", str(output))  # fmt: skip
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


def published(num_requests: int) -> int:
    from dataclasses import replace

    from pdserve.bench.arrivals import ArrivalSpec
    from pdserve.bench.metrics import SLO, attainment
    from pdserve.bench.search import find_goodput
    from pdserve.bench.workloads import Session, Turn
    from pdserve.config import SchedulerConfig
    from pdserve.costmodel.analytic import analytic_profile, model_shape
    from pdserve.sim.deployment import Deployment, SimConfig
    from pdserve.sim.simulator import Simulation

    profile = analytic_profile(model_shape("opt-13b"), "A100-80GB", sizes=(1,))
    config = SimConfig(scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                                 long_prefill_token_threshold=8192),
                       transfer_backend="nvlink")  # fmt: skip
    work = [Session(f"s{i}", [Turn(list(range(i * 600, i * 600 + 512)), 64)])
            for i in range(num_requests)]  # fmt: skip
    slo = SLO(400.0, 40.0)
    runs = {
        "collocated": (Deployment(num_collocated=1), slo, 1),
        # Collocated against one target at a time: which of the two limits it.
        "coll. TTFT": (Deployment(num_collocated=1), SLO(400.0, None), 1),
        "coll. TPOT": (Deployment(num_collocated=1), SLO(None, 40.0), 1),
        # Each phase alone: the other side over-provisioned, only this phase's SLO checked.
        "prefill-only": (Deployment(num_prefill=1, num_decode=4), SLO(400.0, None), 1),
        "decode-only": (Deployment(num_prefill=4, num_decode=1), SLO(None, 40.0), 1),
        "2p1d": (Deployment(num_prefill=2, num_decode=1), slo, 3),
    }
    print(f"{'layout':<14}{'paper req/s':>12}{'predicted':>11}{'ratio':>8}{'per GPU':>9}")
    for name, (deployment, run_slo, gpus) in runs.items():

        def probe(rate: float, deployment=deployment, run_slo=run_slo) -> float:
            result = Simulation(profile, deployment, replace(config)).run(
                work, ArrivalSpec("poisson", rate))  # fmt: skip
            return attainment(result.records, run_slo)

        g = find_goodput(probe, 0.9, 1.0, 10).best_rate
        print(f"{name:<14}{PAPER[name]:>12.1f}{g:>11.2f}{g / PAPER[name]:>8.2f}{g / gpus:>9.2f}")
    return 0


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
        lines.append({"timestamp": int(t), "input_length": 512 * len(history) + new_len,
                      "output_length": output, "hash_ids": hash_ids})  # fmt: skip
        if len(sessions) > 2000:
            sessions.pop(0)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def trace_replay(trace: str | None, num_requests: int, seed: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(trace or Path(tmp) / "trace.jsonl")
        if not trace:
            synthetic_trace(path, num_requests, seed)
        start = time.perf_counter()
        pdserve("simulate", "--profile", "analytic:H100-SXM:llama-3-8b", "--trace", str(path),
                "--num-requests", str(num_requests), "--deployment", "4p4d", "--max-num-seqs",
                "256", "--max-num-batched-tokens", "8192", "--max-model-len", "131072",
                "--routing", "prefix_cache", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
                "--no-progress")  # fmt: skip
        print(f"{'wall time incl. start-up (s)':<40}{time.perf_counter() - start:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("served", "published", "trace-replay"),
                        default="served")  # fmt: skip
    parser.add_argument("--profile", help="an existing profile (default: measure one)")
    parser.add_argument("--num-requests", type=int, help="served 60, published 400, "
                        "trace-replay 12000")  # fmt: skip
    parser.add_argument("--trace", help="trace-replay: a Mooncake-format JSONL trace "
                        "(default: generate one)")  # fmt: skip
    parser.add_argument("--load", type=float, default=0.5, help="rate as a fraction of the "
                        "slowest deployment's predicted capacity")  # fmt: skip
    parser.add_argument("--rates", help="sessions/s per workload instead of --load, "
                        "e.g. chat=0.3,summarization=0.1,multi-turn=0.3")  # fmt: skip
    parser.add_argument("--no-rescale", action="store_true", help="no speed probes")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON with every row")
    args = parser.parse_args()
    if args.mode == "published":
        return published(args.num_requests or 400)
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
        common = [*WORKLOADS[workload], "--num-requests", str(args.num_requests), "--seed",
                  str(args.seed), "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
                  "--no-progress"]  # fmt: skip
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
                rows.append({"workload": workload, "deployment": name, "metric": f"{q} {key}",
                             "rate": float(rates[workload]), "measured": m, "predicted": p,
                             "error": (p - m) / m, "predicted_profile": r,
                             "error_profile": (r - m) / m})  # fmt: skip
    print(f"{'workload':<15}{'deployment':<12}{'metric':<13}{'measured':>10}{'predicted':>11}"
          f"{'error':>9}{'unprobed':>10}{'error':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['workload']:<15}{r['deployment']:<12}{r['metric']:<13}{r['measured']:>10.1f}"
              f"{r['predicted']:>11.1f}{r['error']:>9.1%}{r['predicted_profile']:>10.1f}"
              f"{r['error_profile']:>9.1%}")  # fmt: skip
    for key, label in (("error", "probed"), ("error_profile", "profile as measured")):
        print(f"within 15%, {label}: {sum(abs(r[key]) <= 0.15 for r in rows)}/{len(rows)}")
    if args.output:
        Path(args.output).write_text(json.dumps({"profile": str(profile), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
