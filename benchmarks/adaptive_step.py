"""A step change of load (chat -> summarization -> chat) against one adaptive deployment, each
phase a `pdserve bench` run of its preset while `/v1/status` is polled (docs/adaptive.md, "The
step change"): one JSON line per phase; `--output` keeps every stall and status sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import requests

from pdserve.bench.app import build_plan, execute
from pdserve.bench.cli import add_bench_arguments
from pdserve.bench.metrics import OK, REJECTED
from pdserve.bench.workloads import PRESETS
from pdserve.cluster.config import WorkerGroup
from pdserve.cluster.deployments import pipeline_for
from pdserve.cluster.launcher import Cluster
from pdserve.config import EngineConfig
from pdserve.planner.config import AdaptiveConfig

PHASES = ("chat", "summarization", "chat")


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6)."""
    spans = [(p.partition("-")[0], p.partition("-")[2] or p) for p in text.split(",")]
    return tuple(c for lo, hi in spans for c in range(int(lo), int(hi) + 1))


def phase_plan(args: argparse.Namespace, index: int, url: str):
    """The `bench` plan of phase `index`: its preset's shapes, its rate, `--phase-seconds`."""
    preset = PHASES[index]
    rate = args.chat_rate if preset == "chat" else args.summarization_rate
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    flags = ["--url", url, "--model", args.model, "--tokenizer", args.model, "--no-progress"]
    flags += ["--logprobs"]  # a chunk a token, so a stall is counted in the stream's steps
    flags += ["--preset", preset, "--arrival", "poisson", "--rate", str(rate), "--seed"]
    flags += [str(args.seed + index), "--duration-s", str(args.phase_seconds)]
    flags += ["--num-requests", str(int(3 * rate * args.phase_seconds) + 10)]
    if args.max_output_len:
        output = PRESETS[preset][1].split(":")
        flags += ["--output-len", ":".join([*output[:3], str(args.max_output_len)])]
    return build_plan(parser.parse_args(flags))


class Poller(threading.Thread):
    """Samples /v1/status every `every_s` until `stop` is set."""

    def __init__(self, url: str, every_s: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s, self.t0 = url, every_s, t0
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                status = requests.get(f"{self.url}/v1/status?since=1e18", timeout=5).json()
            except (requests.RequestException, ValueError):
                continue
            planner = status.get("planner") or {}
            targets = {
                w: c["target_threads"]
                for g in planner.get("core_groups", [])
                for w, c in g["workers"].items()
            }
            self.samples.append(
                {
                    "t": time.monotonic() - self.t0,
                    "roles": {w["worker"]: w["role"] for w in status["workers"]},
                    "threads": {w["worker"]: w["threads"] for w in status["workers"]},
                    "targets": targets,
                    "hold_s": [g.get("hold_s") for g in planner.get("core_groups", [])],
                    "num_core_switches": planner.get("num_core_switches", 0),
                    "num_role_switches": planner.get("num_role_switches", 0),
                    "decisions": planner.get("decisions", {}),
                }
            )


def split_of(sample: dict[str, Any]) -> tuple:
    """What a change of the split changes: each worker's role and target threads."""
    return tuple((w, sample["roles"][w], sample["targets"].get(w)) for w in sorted(sample["roles"]))


def phase_changes(
    samples: list[dict[str, Any]], start: float, end: float, load_change: float
) -> dict[str, Any]:
    """The split's changes in [start, end): counts, settle time (from `load_change`, and from
    `start`) and flip-backs."""
    before = [s for s in samples if s["t"] < start]
    inside = [s for s in samples if start <= s["t"] < end]
    if not inside:
        return {}
    first = before[-1] if before else inside[0]
    splits, times, num_core, num_role = [split_of(first)], [], 0, 0
    prev = first
    for s in inside:
        if split_of(s) != splits[-1]:
            num_role += s["roles"] != prev["roles"]
            num_core += s["targets"] != prev["targets"]
            splits.append(split_of(s))
            times.append(s["t"])
        prev = s
    last = inside[-1]
    # A flip-back k undoes change k - 1, which stood from times[k - 2] to times[k - 1]: how
    # long each stood tells a thrash (under the hold) from a move after a lull.
    undone_after = [
        times[k - 1] - times[k - 2] for k in range(2, len(splits)) if splits[k] == splits[k - 2]
    ]
    decisions = {k: n - first["decisions"].get(k, 0) for k, n in last["decisions"].items()}
    return {
        "num_core_group_changes": num_core,
        "num_role_changes": num_role,
        "change_times_s": [round(t - start, 2) for t in times],
        "settle_s": max(0.0, times[-1] - load_change) if times else 0.0,
        "settle_from_start_s": (times[-1] - start) if times else 0.0,
        "num_flip_backs": len(undone_after),
        "undone_after_s": [round(t, 1) for t in undone_after],
        "num_core_switches_acked": last["num_core_switches"] - first["num_core_switches"],
        "num_role_switches": last["num_role_switches"] - first["num_role_switches"],
        "decisions": {k: n for k, n in decisions.items() if n},
        "splits": [list(x) for x in splits],
    }


def run_phases(args: argparse.Namespace, url: str) -> tuple[list[dict], list[dict]]:
    plans = [phase_plan(args, i, url) for i in range(len(PHASES))]
    t0 = time.monotonic()
    poller = Poller(url, args.poll_s, t0)
    poller.start()
    results: list[Any] = [None] * len(PHASES)
    runs_s = [0.0] * len(PHASES)  # each phase's run start, s after t0 (its records' zero)

    def phase(i: int) -> None:
        time.sleep(max(0.0, t0 + i * args.phase_seconds - time.monotonic()))
        runs_s[i] = time.monotonic() - t0
        results[i] = execute(plans[i])

    threads = [threading.Thread(target=phase, args=(i,)) for i in range(len(PHASES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2 * args.poll_s)
    poller.stop.set()
    poller.join()
    rows = []
    spans = [
        (runs_s[i] + r.send_s, runs_s[i] + r.send_s + (r.e2e_s or 0.0))
        for i, (_, result) in enumerate(results)
        for r in result.records
    ]
    for i, (document, result) in enumerate(results):
        summary = document["summary"]
        start, end = i * args.phase_seconds, (i + 1) * args.phase_seconds
        gaps = stalls(result.records, runs_s[i], 0.0)
        long_gaps = [g for g in gaps if g["gap_s"] > args.stall_s]
        text_gaps = stalls(result.records, runs_s[i], args.stall_s, "itl_s")
        first = runs_s[i] + min((r.send_s for r in result.records), default=0.0)
        overlap = first_overlap(result.records, runs_s[i], spans) or first
        changes = phase_changes(poller.samples, start, end, overlap)
        rows.append(
            {
                "phase": PHASES[i],
                "num_sent": len(result.records),
                "num_finished": sum(r.status == OK for r in result.records),
                "num_rejected": sum(r.status == REJECTED for r in result.records),
                "num_failed": sum(r.status not in (OK, REJECTED) for r in result.records),
                "errors": sorted({r.error for r in result.records if r.error})[:5],
                "max_gap_s": max((g["gap_s"] for g in gaps), default=None),
                "max_gap_end_s": max(gaps, key=lambda g: g["gap_s"])["end_s"] - start
                if gaps
                else None,
                "num_stalled": len({g["request"] for g in long_gaps}),
                "stalls": long_gaps,
                # A reader's gaps: one spans two steps where a token's text was held back
                # (random weights' lone bytes), so these count requests no step stalled too.
                "num_text_stalled": len({g["request"] for g in text_gaps}),
                "max_text_gap_s": max((g["gap_s"] for g in text_gaps), default=None),
                "first_request_s": round(first - start, 3),
                "first_overlap_s": round(overlap - start, 3),
                "settle_from_first_request_s": max(
                    0.0, changes["settle_from_start_s"] + start - first
                )
                if changes.get("change_times_s")
                else 0.0,
                "ttft_ms": summary["ttft_ms"],
                "tpot_ms": summary["tpot_ms"],
                **changes,
            }
        )
    end = len(PHASES) * args.phase_seconds
    after = phase_changes(poller.samples, end, float("inf"), end)
    return rows, after, poller


def first_overlap(records: list, run_s: float, spans: list[tuple[float, float]]) -> float | None:
    """When the first of `records` was sent while another request was in flight (s after the
    benchmark's start); `spans` are every request's (sent, ended)."""
    for sent in sorted(run_s + r.send_s for r in records):
        if any(a < sent < b for a, b in spans):
            return sent
    return None


def stalls(
    records: list, run_s: float, min_gap_s: float, kind: str = "token_gaps_s"
) -> list[dict[str, Any]]:
    """Every gap over `min_gap_s` between two tokens of a finished request (`kind`
    "itl_s": between two chunks with text): its length, the request, and when it ended (s
    after the benchmark's start, as the split's change times), longest first."""
    out = []
    for r in records:
        if not r.ok or r.ttft_s is None:
            continue
        t = run_s + r.send_s + r.ttft_s
        for g in getattr(r, kind):
            t += g
            if g > min_gap_s:
                out.append({"gap_s": round(g, 3), "end_s": round(t, 3), "request": r.request_id})
    return sorted(out, key=lambda g: -g["gap_s"])


# Left out of the printed line (the JSON of `--output` keeps them).
BULKY = ("stalls", "splits", "errors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--phase-seconds", type=float, default=120.0)
    p.add_argument("--chat-rate", type=float, default=1.0, help="chat requests/s")
    p.add_argument("--summarization-rate", type=float, default=0.25, help="requests/s")
    p.add_argument("--max-output-len", type=int, help="clip the presets' output lengths")
    p.add_argument("--workers", type=int, default=AdaptiveConfig.workers)
    p.add_argument("--cpus", type=parse_cpus, help="the pool, e.g. 0-3 (default: every core)")
    p.add_argument("--slo-ttft-ms", type=float, help="the planner's TTFT target")
    p.add_argument("--slo-itl-ms", type=float, help="the planner's ITL target")
    p.add_argument("--interval-s", type=float, default=AdaptiveConfig.interval_s)
    p.add_argument("--min-dwell-s", type=float, default=AdaptiveConfig.min_dwell_s)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--stall-s", type=float, default=1.0, help="a longer token gap is a stall")
    p.add_argument("--log-level", default="WARNING", help="the cluster's processes' (stderr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="adaptive_step.json")
    args = p.parse_args()
    pipeline = pipeline_for("adaptive", args.model)
    knobs = ("workers", "slo_ttft_ms", "slo_itl_ms", "interval_s", "min_dwell_s")
    adaptive = AdaptiveConfig(enabled=True, **{k: getattr(args, k) for k in knobs})
    workers = WorkerGroup(cpus=args.cpus) if args.cpus else pipeline.workers
    pipeline = dataclasses.replace(pipeline, adaptive=adaptive, workers=workers)
    with Cluster(pipeline, log_level=args.log_level) as url:
        rows, after, poller = run_phases(args, url)
    document = {"config": vars(args), "phases": rows, "after_load": after}
    Path(args.output).write_text(json.dumps(document | {"samples": poller.samples}, indent=1))
    for row in rows:
        settle = round(row.get("settle_s", 0.0) / args.interval_s, 2)
        shown = {k: v for k, v in row.items() if k not in BULKY}
        print(json.dumps(shown | {"settle_intervals": settle}))
    print(f"after the load: changes at {after.get('change_times_s')} s after its end")


if __name__ == "__main__":
    main()
