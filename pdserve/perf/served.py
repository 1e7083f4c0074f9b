"""What a served request costs beyond the engine's steps (`ServedOverhead`), measured by
`pdserve profile` through real deployments started by the embedded launcher: a collocated
one on every core (the serving stack's two legs and its CPU per token) and a 1p1d (a prefill
worker's first-token hop and the decode worker's start). docs/simulator.md, "Profiles".

Torch-free itself (the workers are processes); imported by perf/measure.py only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.costmodel.profile import ServedOverhead

if TYPE_CHECKING:
    from pdserve.bench.tokens import TokenSource

TOKEN_CPU_REQUESTS = 4  # `pdserve bench` requests timed for `ServedOverhead.token_cpu_s`
TOKEN_CPU_PROMPT = 128  # prompt tokens each
TOKEN_CPU_TOKENS = 64  # new tokens each
REMOTE_PROMPTS = (32, 256)  # prompt tokens of the lone remote prefills sent through a 1p1d


def served_overhead(
    model: str,
    kv_cache_bytes: int | None,
    num_requests: int,
    one_thread_decode: Callable[[int], float] | None = None,
) -> ServedOverhead:
    """Medians over `served_requests` short prompts sent one at a time to a collocated
    deployment on every core (as `bench compare` starts it), each asking for the router's
    TTFT breakdown (router/timing.py): `token_s` is its first_token part (step end ->
    router), `request_s` the rest of the client's TTFT beyond the worker's prefill step.
    Then `token_cpu_s`, the router's and the bench client's CPU per streamed token over a
    `pdserve bench` run there at batch 1. Then, with two cores or more, a prefill worker's
    first-token hop (`remote_prefill`) and the decode worker's start against
    `one_thread_decode(context)`, its model's step for one request (None: 0)."""
    from pdserve.bench.tokens import TokenSource
    from pdserve.cluster.deployments import pipeline_for
    from pdserve.cluster.launcher import Cluster

    if not num_requests:
        return ServedOverhead()
    rng = np.random.default_rng(0)
    source = TokenSource.load(model)  # the ids `pdserve bench` sends
    requests, tokens = [], []
    cluster = Cluster(pipeline_for("collocated", model, kv_cache_bytes), log_level="WARNING")
    with cluster as url:
        for i in range(num_requests + 2):  # two to warm the path up
            prompt = source.random_ids(rng, 16)
            client_ttft_s, parts = first_token(url, model, prompt)
            if i >= 2:
                tokens.append(parts["first_token"])
                requests.append(client_ttft_s - parts["prefill"] - parts["first_token"])
        router = next(p.popen.pid for p in cluster.processes if p.name == "router")
        token_cpu_s = bench_token_cpu_s(url, model, router)
    remote, token_s = {}, statistics.median(tokens)
    if len(os.sched_getaffinity(0)) >= 2:
        # D's first step, then its token's hop back
        decode = one_thread_decode and (lambda n: one_thread_decode(n) + token_s)
        remote = remote_prefill(model, kv_cache_bytes, num_requests // 2, source, rng, decode)
    return ServedOverhead(
        max(0.0, statistics.median(requests)), token_s, token_cpu_s=token_cpu_s, **remote
    )


def remote_prefill(
    model: str,
    kv_cache_bytes: int | None,
    num_requests: int,
    source: TokenSource,
    rng: np.random.Generator,
    decode_token_s: Callable[[int], float] | None = None,
) -> dict[str, float]:
    """Through a served 1p1d (a worker per core), lone prompts of each of REMOTE_PROMPTS'
    lengths, `num_requests` each (at least 2): the prefill worker's first token's hop
    (`remote_token_s`). Then the hand-off: from the router's first token to the decode
    worker's, less `decode_token_s(context)` (its first step and that token's hop back), is
    how long the decode worker took to start (`start_decode_s`; 0 without
    `decode_token_s`). The prefill worker's steps are its cost model's: it keeps the
    weights of the engine the profile times (cpu_linear.py), so none of its time is priced
    apart."""
    from pdserve.cluster.deployments import pipeline_for
    from pdserve.cluster.launcher import Cluster

    hops, starts = [], []
    with Cluster(pipeline_for("1p1d", model, kv_cache_bytes), log_level="WARNING") as url:
        for i in range(max(2, num_requests) + 1):
            for n in REMOTE_PROMPTS:
                _, parts = first_token(url, model, source.random_ids(rng, n), max_tokens=2)
                if i:  # the first round warms the path and the engine up
                    hops.append(parts["first_token"])
                    if decode_token_s and "handover" in parts:
                        # prefill_end -> kv_landed -> D's token, less prefill_end -> P's
                        handoff_s = parts["transfer"] + parts["handover"] - parts["first_token"]
                        starts.append(handoff_s - decode_token_s(n + 1))
    return {
        "remote_token_s": statistics.median(hops),
        "start_decode_s": max(0.0, statistics.median(starts)) if starts else 0.0,
    }


def bench_token_cpu_s(url: str, model: str, router_pid: int) -> float:
    """The CPU, the router's and the client's, per streamed token (0 where /proc cannot tell)
    of `TOKEN_CPU_REQUESTS` greedy requests sent one at a time by `pdserve bench` in its own
    process: the client whose figures `pdserve simulate` predicts, and whose CPU (with the
    router's) the worker's threads share its cores with."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        router_s = cpu_s(router_pid)
        run_bench(
            url,
            model,
            TOKEN_CPU_REQUESTS,
            str(TOKEN_CPU_PROMPT),
            str(TOKEN_CPU_TOKENS),
            "--max-concurrency",
            "1",
            "--output",
            str(out),
        )
        router_s = cpu_s(router_pid) - router_s
        document = json.loads(out.read_text())
    num_tokens = sum(r["output_len"] for r in document["records"])
    token_cpu_s = (router_s + document["client_cpu_s"]) / num_tokens if num_tokens else 0.0
    return max(0.0, token_cpu_s)


def run_bench(
    url: str, model: str, num_requests: int, input_len: str, output_len: str, *flags: str
) -> None:
    """`pdserve bench` in its own process (the client `pdserve simulate` predicts), its
    output discarded; `flags`: its arrival and the rest."""
    argv = [
        sys.executable,
        "-m",
        "pdserve.bench",
        "--url",
        url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--num-requests",
        str(num_requests),
        "--input-len",
        input_len,
        "--output-len",
        output_len,
        "--no-progress",
        *flags,
    ]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has run so far; 0 without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_token(
    url: str, model: str, prompt: list[int], max_tokens: int = 1
) -> tuple[float, dict[str, float]]:
    """(the client's TTFT, the router's TTFT parts) of one streamed greedy completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-PDServe-Timing": "1"},
    )
    start = time.perf_counter()
    ttft_s, parts = None, None
    try:
        response = urllib.request.urlopen(request, timeout=120)
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200]
        raise RuntimeError(f"served request to {url}: HTTP {exc.code}: {detail!r}") from None
    with response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            # The router streams the first token's chunk even when its text is empty.
            if ttft_s is None and event.get("choices"):
                ttft_s = time.perf_counter() - start
            parts = (event.get("pdserve_timing") or {}).get("ttft_parts_s", parts)
    if ttft_s is None or not parts or "prefill" not in parts:
        raise RuntimeError(f"served request to {url}: no token or no TTFT breakdown came back")
    return ttft_s, parts
