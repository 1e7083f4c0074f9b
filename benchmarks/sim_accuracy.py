"""Simulator accuracy on this machine: predicted against measured p50/p90 TTFT and TPOT.

    .venv/bin/python benchmarks/sim_accuracy.py [--profile cpu.json] [--num-requests 30]
        [--load 0.5 | --rates chat=0.3,...] [--no-rescale] [--measured-dir DIR]

`pdserve profile` (unless `--profile`), then per workload (chat, summarization, multi-turn)
and deployment (collocated on every core, 1p1d and two collocated workers one core each):
`pdserve bench compare` on the real deployment and `pdserve simulate` with the same flags and
seed (the same sessions and send times). A speed probe (`pdserve profile --rescale`) runs
around each deployment; each is simulated with the profile rescaled by the mean of the probes
on either side ("probed") and as measured. The rate is `--load` x the capacity the profile
predicts for the slowest deployment. `--measured-dir` re-prices a run's measurements with
another profile. Needs a quiet machine (docs/simulator.md, "Accuracy").
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="an existing profile (default: measure one)")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--load", type=float, default=0.5, help="rate as a fraction of the "
                        "slowest deployment's predicted capacity")  # fmt: skip
    parser.add_argument("--rates", help="sessions/s per workload instead of --load, "
                        "e.g. chat=0.3,summarization=0.1,multi-turn=0.3")  # fmt: skip
    parser.add_argument("--no-rescale", action="store_true", help="no speed probes")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON with every row")
    parser.add_argument("--measured-dir", help="a former run's directory: compare against its "
                        "measured results (and probes) instead of running again")  # fmt: skip
    args = parser.parse_args()
    rates = dict(item.split("=") for item in args.rates.split(",")) if args.rates else {}
    tmp = Path(tempfile.mkdtemp(prefix="sim_accuracy_"))
    runs = Path(args.measured_dir or tmp)
    profile = Path(args.profile or tmp / "profile.json")
    if not args.profile:
        threads = ",".join(str(t) for t in sorted({1, CORES}))
        pdserve("profile", "--threads", threads, "--output", str(profile))
    names = args.deployments.split(",")
    probing = not (args.no_rescale or args.measured_dir)
    rows = []
    for workload in args.workloads.split(","):
        common = [*WORKLOADS[workload], "--num-requests", str(args.num_requests), "--seed",
                  str(args.seed), "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
                  "--no-progress"]  # fmt: skip
        probes = [runs / f"{workload}-probe{i}.json" for i in range(len(names) + 1)]
        if probing:
            pdserve("profile", "--rescale", str(profile), "--output", str(probes[0]))
        if args.measured_dir:  # the rate those runs had
            first_run = runs / f"{workload}-{names[0]}-measured.json"
            rates[workload] = str(json.loads(first_run.read_text())["config"]["rate"])
        elif workload not in rates:
            first = profile if args.no_rescale else probes[0]
            rates[workload] = f"{args.load * capacity(common, first, names, tmp):.4g}"
            print(f"{workload}: rate {rates[workload]} sessions/s", flush=True)
        common += ["--rate", rates[workload]]
        for i, name in enumerate(names):
            measured_file = runs / f"{workload}-{name}-measured.json"
            if not args.measured_dir:
                spec = f"--deployment={name}={DEPLOYMENTS[name][0]}"
                pdserve("bench", "compare", *common, spec, "--output", str(measured_file))
                if probing:
                    pdserve("profile", "--rescale", str(profile), "--output", str(probes[i + 1]))
            measured = json.loads(measured_file.read_text())["compare"][name]["summary"]
            raw = simulate(common, profile, name, tmp / f"{workload}-{name}-profile.json")
            predicted = raw
            if not args.no_rescale:
                if not all(p.exists() for p in probes[i : i + 2]):
                    sys.exit(f"{runs} has no probes for {workload}: pass --no-rescale")
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
