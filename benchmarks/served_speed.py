"""Served speed: batch-1 TPOT, output tok/s at 32 concurrent, TTFT of 512-token prompts,
against the engine's own offline TPOT, and (`--llama-server`) against llama.cpp (BENCHMARKS.md,
"Served speed" and "Models and quantized weights"; build_llama_server.sh builds the peer).

Each round, for each `--variant` (environment variables for the worker and the offline engine),
the engine runs offline (`LLM.stream` in a fresh process, one request at a time), then `pdserve
up --collocated 1 --threads T` is driven by `pdserve bench` in its own process, and
`llama-server` on the same GGUF (a slot per concurrent request) by the same client; servers
alternate round by round, medians printed. With `--gguf`, each round also measures the read
bandwidth (`--threads` threads summing 1 GiB) and prints batch-1 TPOT against the bound it sets
(the bytes a decode step reads over it). `--cold-start`: seconds from launching each server
(`pdserve up` 1P1D, `llama-server -c CTX`) to its first answered chat request, alternating, and
pdserve's PSS over all its processes against the file and the KV pools; `--drop-caches` (root)
empties the page cache before each launch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from pdserve.cluster.launcher import free_port
from pdserve.model.registry import known_gguf_path

MODEL = "smollm2-135m"
COLD_START_LIMIT_S = 600
# figure -> (label, issue target for pdserve's advantage, whether larger is better)
FIGURES = {
    "served_tpot_ms": ("TPOT ms at batch 1", 1.3, False),
    "tok_s_at_32": ("output tok/s at 32 concurrent", 2.5, True),
    "ttft_long_ms": ("TTFT ms, long prompt", 3.0, False),
}


def offline_tpot_ms(
    model: str, threads: int, input_len: int, output_len: int, num_requests: int
) -> float:
    """Median TPOT of single requests on an in-process engine (run in a child process)."""
    import torch

    from pdserve import LLM, SamplingParams

    llm = LLM(model, threads=threads)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    tpots = []
    for i in range(num_requests + 1):
        prompt = torch.randint(1000, 40000, (input_len,), generator=gen).tolist()
        stamps = [time.perf_counter() for _ in llm.stream([prompt], params)]
        if i:  # the first request warms the kernels up
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000)
    return statistics.median(tpots)


def run_client(url: str, model: str, **flags) -> dict:
    """One `pdserve bench` run in its own process, as a real client; its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [
            sys.executable,
            "-m",
            "pdserve.bench",
            "--url",
            url,
            "--model",
            model,
            "--output",
            str(out),
            "--no-progress",
            "--seed",
            "1",
        ]
        for name, value in flags.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["summary"]


def served_figures(url: str, args: argparse.Namespace) -> dict[str, float]:
    """p50 TPOT at concurrency 1, tok/s at `--concurrent`, p50 TTFT of long prompts."""
    length = {"input_len": args.input_len, "output_len": args.output_len}
    run_client(url, args.model, num_requests=1, **length)  # warm-up
    s = run_client(url, args.model, num_requests=args.requests, max_concurrency=1, **length)
    row = {"served_tpot_ms": s["tpot_ms"]["p50"]}
    if args.concurrent:
        s = run_client(
            url,
            args.model,
            num_requests=2 * args.concurrent,
            max_concurrency=args.concurrent,
            **length,
        )
        row["tok_s_at_32"] = s["output_tokens_per_s"]
    if args.long_input_len:
        s = run_client(
            url,
            args.model,
            num_requests=args.requests,
            max_concurrency=1,
            input_len=args.long_input_len,
            output_len=4,
        )
        row["ttft_long_ms"] = s["ttft_ms"]["p50"]
    return row


def pdserve_up(args: argparse.Namespace, port: int, *layout: str) -> list[str]:
    """`pdserve up` of `--model` on `port`: `layout` its workers, `--threads` each."""
    return [
        str(Path(sys.executable).with_name("pdserve")),
        "up",
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--port",
        str(port),
        *layout,
    ]


@contextmanager
def serving(cmd: list[str], port: int, model: str, env: dict[str, str] | None = None):
    """`cmd` launched and sent one chat request until it answers: yields (seconds from the
    launch to that answer, its pid); the server is stopped on exit."""
    url = f"http://127.0.0.1:{port}"
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    log_path = Path(tempfile.gettempdir()) / f"served-speed-{Path(cmd[0]).name}-{port}.log"
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None and time.monotonic() - start < COLD_START_LIMIT_S:
                try:
                    with urllib.request.urlopen(request, timeout=COLD_START_LIMIT_S):
                        break
                except (urllib.error.URLError, OSError):
                    time.sleep(0.2)  # not listening, or no worker ready (503) yet
            else:
                raise RuntimeError(f"{cmd[0]}: no answer (see {log_path})")
            yield time.monotonic() - start, proc.pid
        finally:
            proc.terminate()
            proc.wait(60)


def measure_pdserve(variant: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    """Offline TPOT in a fresh process, then `pdserve up --collocated 1` driven by the client,
    both with the variant's environment."""
    env = {**os.environ, **variant}
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import served_speed as s; print(s.offline_tpot_ms({args.model!r}, {args.threads}, "
        f"{args.input_len}, {args.output_len}, {args.requests}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    row = {"offline_tpot_ms": float(out.stdout.strip().splitlines()[-1])}
    port = free_port()
    with serving(pdserve_up(args, port, "--collocated", "1"), port, args.model, env):
        row.update(served_figures(f"http://127.0.0.1:{port}", args))
    row["served_over_offline"] = row["served_tpot_ms"] / row["offline_tpot_ms"]
    return row


def llama_server(args: argparse.Namespace, port: int, *flags: str) -> list[str]:
    return [
        args.llama_server,
        "-m",
        str(args.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        *flags,
    ]


def measure_llamacpp(args: argparse.Namespace) -> dict[str, float]:
    """llama-server on the same GGUF, a slot per concurrent request, driven by the client."""
    slots, port = max(args.concurrent, 1), free_port()
    longest = max(args.input_len + args.output_len, args.long_input_len + 4) + 1
    cmd = llama_server(
        args,
        port,
        "-np",
        str(slots),
        "-c",
        str(slots * -(-longest // 256) * 256),
        "-tb",
        str(args.threads),
        "--cont-batching",
    )
    with serving(cmd, port, args.model):
        return served_figures(f"http://127.0.0.1:{port}", args)


def process_tree(pid: int) -> list[int]:

    pids, todo = [], [pid]
    while todo:
        pids.append(todo.pop())
        for task in Path(f"/proc/{pids[-1]}/task").glob("*"):
            todo += [int(c) for c in (task / "children").read_text().split()]
    return pids


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (a page shared by n processes counts 1/n)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def pdserve_memory(args: argparse.Namespace, pid: int) -> dict[str, float]:
    """The PSS of every pdserve process (launcher, router, workers) over the file's size
    and the two workers' KV pools: the claim is at most 1.3 x the file plus the pools."""
    pss = sum(pss_bytes(p) for p in process_tree(pid))
    pools = 2 * args.kv_cache_bytes
    return {"pss_gib": pss / 2**30, "over_file": (pss - pools) / Path(args.model).stat().st_size}


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cold_start(cmd: list[str], port: int, args: argparse.Namespace, memory: bool) -> dict:
    with serving(cmd, port, args.model) as (seconds, pid):
        return {"cold_start_s": seconds} | (pdserve_memory(args, pid) if memory else {})


def cold_start_rounds(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Each round launches every server once, alternating which goes first."""
    port = free_port()
    pdserve = pdserve_up(
        args, port, "--prefill", "1", "--decode", "1", "--kv-cache-bytes", str(args.kv_cache_bytes)
    )
    servers = {"pdserve": lambda: cold_start(pdserve, port, args, memory=True)}
    if args.llama_server:
        llama = llama_server(args, port, "-c", str(args.ctx_size))
        servers["llama.cpp"] = lambda: cold_start(llama, port, args, memory=False)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for r in range(args.rounds):
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            if args.drop_caches:
                drop_page_cache()
            rows[name].append(servers[name]() | {"load_avg": os.getloadavg()[0]})
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    return rows


def step_bytes(gguf: Path) -> int:
    """The bytes of weights a decode step reads: every matrix, the token embedding only where it
    is also the output head (a lookup reads a few rows)."""
    from gguf import GGML_QUANT_SIZES

    from pdserve.model.gguf_header import read_header

    _, tensors = read_header(gguf)
    names = {t.name for t in tensors}
    total = 0
    for t in tensors:
        if len(t.shape) < 2 or (t.name == "token_embd.weight" and "output.weight" in names):
            continue
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        total += int(math.prod(t.shape)) // block * type_size
    return total


def read_gbs(threads: int) -> float:
    """GB/s `threads` threads read at (the median of 5 sums over 1 GiB, in a child process so
    the benchmark's own torch threads stay idle)."""
    code = (
        "import statistics, time, torch\n"
        f"torch.set_num_threads({threads})\n"
        "x = torch.ones(256 * 2**20); x.sum()\n"
        "ts = []\n"
        "for _ in range(5):\n"
        "    t = time.perf_counter(); x.sum(); ts.append(time.perf_counter() - t)\n"
        "print(x.numel() * 4 / statistics.median(ts) / 1e9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def print_cold_start(rows: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    cache = "dropped before each launch" if args.drop_caches else "warm"
    print(f"{args.model}: {args.rounds} rounds, page cache {cache}; medians")
    med = {
        n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items()
    }
    for name, figures in med.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    if "llama.cpp" in med:
        ratio = med["pdserve"]["cold_start_s"] / med["llama.cpp"]["cold_start_s"]
        print(f"pdserve's cold start over llama.cpp's: {ratio:.2f}x (target: at most 2x)")


def print_speed(
    rows: dict[str, list[dict[str, float]]], bandwidth: list[float], args: argparse.Namespace
) -> None:
    med = {
        n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items()
    }
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds")
    for name, figures in med.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    if bandwidth:
        gbs = statistics.median(bandwidth)
        bound_ms = step_bytes(args.gguf) / gbs / 1e6
        print(
            f"read bandwidth {gbs:.1f} GB/s ({args.threads} threads): batch-1 bound "
            f"{bound_ms:.2f} ms a token"
        )
        for name, figures in med.items():
            if "served_tpot_ms" in figures:
                print(f"{name}: TPOT {figures['served_tpot_ms'] / bound_ms:.2f}x the bound")
    if args.llama_server:
        ours = med[next(iter(rows))]
        print("| figure | pdserve | llama.cpp | pdserve's advantage | target |")
        print("|---" * 5 + "|")
        for key, (label, target, higher) in FIGURES.items():
            if key in ours:
                a, b = ours[key], med["llama.cpp"][key]
                ratio = a / b if higher else b / a
                print(f"| {label} | {a:.4g} | {b:.4g} | {ratio:.2f}x | {target}x |")


def add_cold_start_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="launch to first answer, 1P1D (docstring); needs --gguf",
    )
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per worker")
    ap.add_argument("--ctx-size", type=int, default=4096, help="llama-server's -c")
    ap.add_argument(
        "--drop-caches", action="store_true", help="empty the page cache before each launch (root)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:VAR=VALUE,... (repeatable; default: pdserve's own)",
    )
    ap.add_argument("--llama-server", help="a llama-server binary to compare with")
    ap.add_argument("--gguf", type=Path, help=f"the model both serve (default: {MODEL}'s GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per figure")
    ap.add_argument("--concurrent", type=int, default=32, help="0: skip the concurrent run")
    ap.add_argument("--long-input-len", type=int, default=512, help="0: skip the TTFT run")
    ap.add_argument("--json", help="write every round's rows here")
    add_cold_start_args(ap)
    args = ap.parse_args()
    args.model = str(args.gguf) if args.gguf else MODEL
    if args.cold_start:
        if not args.gguf:
            ap.error("--cold-start: --gguf names the file both servers start on")
        rows = cold_start_rounds(args)
        print_cold_start(rows, args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    servers = {}
    for spec in args.variant or ["pdserve:"]:
        name, _, rest = spec.partition(":")
        env = dict(item.split("=", 1) for item in rest.split(",") if item)
        servers[name] = lambda a, env=env: measure_pdserve(env, a)
    if args.llama_server:
        if not os.access(args.llama_server, os.X_OK):
            ap.error(f"--llama-server {args.llama_server!r}: not an executable file")
        args.gguf = args.gguf or known_gguf_path(MODEL)
        servers["llama.cpp"] = measure_llamacpp
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    bandwidth = []
    for r in range(args.rounds):
        if args.gguf:
            bandwidth.append(read_gbs(args.threads))
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            rows[name].append(servers[name](args))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    print_speed(rows, bandwidth, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
