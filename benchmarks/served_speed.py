"""Served speed against the engine offline and llama.cpp, and `--cold-start` (BENCHMARKS.md,
"Served speed" and "Models and quantized weights"): each round every server in turn (the order
alternating) is driven by `pdserve bench` in its own process; medians printed. `--gguf` adds
batch-1 TPOT over the bound that `--threads` threads' read bandwidth sets. `--router-cpu` adds
the pdserve router's CPU (user + system, every thread) per streamed token at batch 1 and at
`--concurrent`, and the client's: on a host whose cores the worker's threads fill, that CPU is
taken from them.
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
from pdserve.perf.served import cpu_s

MODEL = "smollm2-135m"
COLD_START_LIMIT_S = 600
# figure -> (label, issue target for pdserve's advantage, whether larger is better)
FIGURES = {
    "served_tpot_ms": ("TPOT ms at batch 1", 1.3, False),
    "tok_s_at_32": ("output tok/s at 32 concurrent", 2.5, True),
    "ttft_long_ms": ("TTFT ms, long prompt", 3.0, False),
}
HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


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


def run_client(url: str, model: str, seed: int, router_pid: int = 0, **flags) -> dict:
    """One `pdserve bench` run in its own process, as a real client, its prompts drawn from
    `seed`; its summary, and with `router_pid` the router's and the client's CPU ms per
    streamed token (`*_cpu_ms`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "pdserve.bench", "--no-progress", "--seed", str(seed)]
        flags |= {"url": url, "model": model, "output": out}
        for name, value in flags.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        router_s = cpu_s(router_pid) if router_pid else 0.0
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        document = json.loads(out.read_text())
    summary = document["summary"]
    if router_pid and summary["total_output_tokens"]:
        ms = 1e3 / summary["total_output_tokens"]
        summary["router_cpu_ms"] = (cpu_s(router_pid) - router_s) * ms
        summary["client_cpu_ms"] = document["client_cpu_s"] * ms
    return summary


def served_figures(url: str, args: argparse.Namespace, router_pid: int = 0) -> dict[str, float]:
    """p50 TPOT at concurrency 1, tok/s at `--concurrent`, p50 TTFT of long prompts; with
    `router_pid`, the router's and the client's CPU per token in the first two runs. Each run
    draws its prompts from a seed of its own: with one seed, each long prompt began with a
    short one of an earlier run, which a prefix cache then served (a quarter of 512 tokens)."""
    client = lambda seed, **flags: run_client(url, args.model, seed, **flags)  # noqa: E731
    length = {"input_len": args.input_len, "output_len": args.output_len}
    client(1, num_requests=1, **length)  # warm-up
    s = client(2, num_requests=args.requests, max_concurrency=1, router_pid=router_pid, **length)
    row = {"served_tpot_ms": s["tpot_ms"]["p50"]}
    row |= {f"{k}_b1": s[k] for k in ("router_cpu_ms", "client_cpu_ms") if k in s}
    if args.concurrent:
        n, c = 2 * args.concurrent, args.concurrent
        s = client(3, num_requests=n, max_concurrency=c, router_pid=router_pid, **length)
        row["tok_s_at_32"] = s["output_tokens_per_s"]
        row |= {f"{k}_at_{c}": s[k] for k in ("router_cpu_ms", "client_cpu_ms") if k in s}
    if args.long_input_len:
        long = {"input_len": args.long_input_len, "output_len": 4}
        s = client(4, num_requests=args.requests, max_concurrency=1, **long)
        row["ttft_long_ms"] = s["ttft_ms"]["p50"]
    return row


def pdserve_up(args: argparse.Namespace, port: int, *layout: str) -> list[str]:
    """`pdserve up` of `--model` on `port`: `layout` its workers, `--threads` each."""
    up = ["up", "--model", args.model, "--threads", str(args.threads), "--port", str(port)]
    return [str(Path(sys.executable).with_name("pdserve")), *up, *layout]


@contextmanager
def serving(cmd: list[str], port: int, model: str, env: dict[str, str] | None = None):
    """`cmd` launched and sent one chat request until it answers: yields (seconds from the
    launch to that answer, its pid); the server is stopped on exit."""
    body = json.dumps({"model": model, "temperature": 0, **HELLO}).encode()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
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
    """Offline TPOT in a fresh process (unless `--no-offline`), then `pdserve up --collocated
    1` driven by the client, both with the variant's environment."""
    env = {**os.environ, **variant}
    row = {}
    if args.offline:
        row["offline_tpot_ms"] = offline_tpot_ms_in_child(env, args)
    port = free_port()
    with serving(pdserve_up(args, port, "--collocated", "1"), port, args.model, env) as (_, pid):
        router = router_pid(pid) if args.router_cpu else 0
        row.update(served_figures(f"http://127.0.0.1:{port}", args, router))
    if args.offline:
        row["served_over_offline"] = row["served_tpot_ms"] / row["offline_tpot_ms"]
    return row


def router_pid(launcher_pid: int) -> int:
    """The router process that `pdserve up` (`launcher_pid`) started."""
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            if b"pdserve.router.main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError(f"no router process under pdserve up (pid {launcher_pid})")


def offline_tpot_ms_in_child(env: dict[str, str], args: argparse.Namespace) -> float:
    """offline_tpot_ms() in a child process with `env` (a variant's PYTHONPATH applies)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import served_speed as s; print(s.offline_tpot_ms({args.model!r}, {args.threads}, "
        f"{args.input_len}, {args.output_len}, {args.requests}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    return float(out.stdout.strip().splitlines()[-1])


def llama_server(args: argparse.Namespace, port: int, *flags: str) -> list[str]:
    where = ["--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    return [args.llama_server, "-m", str(args.gguf), *where, *flags]


def measure_llamacpp(args: argparse.Namespace) -> dict[str, float]:
    """llama-server on the same GGUF, a slot per concurrent request, driven by the client."""
    slots, port = max(args.concurrent, 1), free_port()
    longest = max(args.input_len + args.output_len, args.long_input_len + 4) + 1
    ctx = str(slots * -(-longest // 256) * 256)
    flags = ["-np", str(slots), "-c", ctx, "-tb", str(args.threads), "--cont-batching"]
    with serving(llama_server(args, port, *flags), port, args.model):
        return served_figures(f"http://127.0.0.1:{port}", args)


def pdserve_pss_bytes(pid: int) -> int:
    """The proportional set size (a page shared by n processes counts 1/n) of `pid` and every
    process under it."""
    total, todo = 0, [pid]
    while todo:
        proc = Path(f"/proc/{todo.pop()}")
        rollup = (proc / "smaps_rollup").read_text()
        total += int(rollup.split("\nPss:")[1].split()[0]) * 1024
        for task in (proc / "task").glob("*"):
            todo += [int(c) for c in (task / "children").read_text().split()]
    return total


def cold_start(cmd: list[str], port: int, args: argparse.Namespace, memory: bool) -> dict:
    """Seconds to the first answer; for pdserve, the PSS of every process (launcher, router,
    workers) over the file's size less the two workers' KV pools (the claim: at most 1.3)."""
    if args.drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    with serving(cmd, port, args.model) as (seconds, pid):
        row = {"cold_start_s": seconds, "load_avg": os.getloadavg()[0]}
        if memory:
            pss = pdserve_pss_bytes(pid)
            over = (pss - 2 * args.kv_cache_bytes) / Path(args.model).stat().st_size
            row |= {"pss_gib": pss / 2**30, "over_file": over}
        return row


def cold_start_servers(args: argparse.Namespace) -> dict:
    """pdserve 1P1D and llama-server with `--ctx-size`, each launched once a round."""
    port = free_port()
    kv = ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    pdserve = pdserve_up(args, port, "--prefill", "1", "--decode", "1", *kv)
    servers = {"pdserve": lambda a: cold_start(pdserve, port, a, memory=True)}
    if args.llama_server:
        llama = llama_server(args, port, "-c", str(args.ctx_size))
        servers["llama.cpp"] = lambda a: cold_start(llama, port, a, memory=False)
    return servers


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


def print_medians(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    med = {
        n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items()
    }
    for name, figures in med.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    return med


def print_cold_start(rows: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    cache = "dropped before each launch" if args.drop_caches else "warm"
    print(f"{args.model}: {args.rounds} rounds, page cache {cache}; medians")
    med = print_medians(rows)
    if "llama.cpp" in med:
        ratio = med["pdserve"]["cold_start_s"] / med["llama.cpp"]["cold_start_s"]
        print(f"pdserve's cold start over llama.cpp's: {ratio:.2f}x (target: at most 2x)")


def print_speed(rows: dict, bandwidth: list[float], args: argparse.Namespace) -> None:
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds")
    med = print_medians(rows)
    if bandwidth:
        gbs = statistics.median(bandwidth)
        bound_ms = step_bytes(args.gguf) / gbs / 1e6
        print(f"read {gbs:.1f} GB/s ({args.threads} threads): batch-1 bound {bound_ms:.2f} ms")
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


def speed_servers(args: argparse.Namespace) -> dict:
    """Each `--variant` of pdserve (by default its own settings), and llama-server."""
    servers = {}
    for spec in args.variant or ["pdserve:"]:
        name, _, rest = spec.partition(":")
        env = dict(item.split("=", 1) for item in rest.split(",") if item)
        servers[name] = lambda a, env=env: measure_pdserve(env, a)
    if args.llama_server:
        args.gguf = args.gguf or known_gguf_path(MODEL)
        servers["llama.cpp"] = measure_llamacpp
    return servers


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME:VAR=VALUE,... (repeat)")
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
    ap.add_argument(
        "--router-cpu",
        action="store_true",
        help="pdserve's router and client CPU ms per streamed token (from /proc)",
    )
    ap.add_argument(
        "--no-offline",
        dest="offline",
        action="store_false",
        help="skip the in-process engine's TPOT (its libgomp spins: slow beside other load)",
    )
    ap.add_argument("--cold-start", action="store_true", help="launch to first answer (1P1D)")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per worker")
    ap.add_argument("--ctx-size", type=int, default=4096, help="llama-server's -c")
    ap.add_argument("--drop-caches", action="store_true", help="before each launch (root)")
    args = ap.parse_args()
    if args.cold_start and not args.gguf:
        ap.error("--cold-start: --gguf names the file both servers start on")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        ap.error(f"--llama-server {args.llama_server!r}: not an executable file")
    args.model = str(args.gguf) if args.gguf else MODEL
    return args


def main() -> None:
    args = parse_args()
    servers = (cold_start_servers if args.cold_start else speed_servers)(args)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    bandwidth = []
    for r in range(args.rounds):
        if args.gguf and not args.cold_start:
            bandwidth.append(read_gbs(args.threads))
        for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
            rows[name].append(servers[name](args))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", file=sys.stderr, flush=True)
    if args.cold_start:
        print_cold_start(rows, args)
    else:
        print_speed(rows, bandwidth, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
