"""Served steps against a profile: each step a worker ran (a `PDSERVE_STEP_TRACE` folder) over
what the profile's served cost model predicts for its shape, by worker and kind of step
(decode by batch size; prefill after idle, back to back, or beside decodes). `+cpu` adds the
profile's `token_cpu_s` per streamed token. docs/simulator.md, "Served steps".

    PDSERVE_STEP_TRACE=/tmp/steps pdserve bench compare ... --deployment collocated=collocated
    .venv/bin/python benchmarks/served_steps.py /tmp/steps --profile profile.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pdserve.costmodel.profile import load_profile
from pdserve.costmodel.step_cost import StepShape
from pdserve.workers.step_report import read_trace

IDLE_S = 1.0  # longer than any gap between a busy worker's steps


def kind(shape: StepShape, idle_s: float) -> str:
    if shape.prefill_tokens and shape.decode_requests:
        return "mixed"
    if shape.prefill_tokens:
        return "prefill after idle" if idle_s > IDLE_S else "prefill back to back"
    return f"decode batch {shape.decode_requests if shape.decode_requests < 4 else '4+'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="the PDSERVE_STEP_TRACE folder")
    parser.add_argument("--profile", required=True)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    token_cpu_s = profile.served.token_cpu_s
    print(f"{'worker/threads':18} {'kind':22} {'steps':>6} {'measured ms':>12} {'predicted':>10} "
          f"{'ratio':>6} {'+cpu':>6}")  # fmt: skip
    for path in sorted(Path(args.trace).glob("*.steps.jsonl")):
        by_kind: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        last_end = None
        # a worker id is its role's name and an index (cluster/launcher.py)
        role = path.name.split("-")[0]
        for shape, threads, start, seconds in read_trace(path):
            predicted = profile.served_cost_model(threads, role).predict(shape)
            idle_s = start - last_end if last_end is not None else float("inf")
            last_end = start + seconds
            with_cpu = predicted + token_cpu_s * shape.decode_requests
            key = (threads, kind(shape, idle_s))
            by_kind.setdefault(key, []).append((seconds, predicted, with_cpu))
        for (threads, name), rows in sorted(by_kind.items()):
            worker = f"{path.name.removesuffix('.steps.jsonl')}/{threads}t"
            ratio = statistics.median(s / p for s, p, _ in rows)
            with_cpu = statistics.median(s / c for s, _, c in rows)
            print(f"{worker:18} {name:22} {len(rows):6d} "
                  f"{statistics.median(s for s, _, _ in rows) * 1e3:12.1f} "
                  f"{statistics.median(p for _, p, _ in rows) * 1e3:10.1f} "
                  f"{ratio:6.3f} {with_cpu:6.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
