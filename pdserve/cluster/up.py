"""`pdserve up`: start a cluster from flags or a YAML file and serve until Ctrl-C.

Flags are the Pipeline's fields (`--transfer-mode` is `kv_transfer.mode`), and a WorkerGroup's
fields set every role's workers (`--threads 1`); given with `--config`, flags win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import urllib.request

from pdserve import envs
from pdserve.cluster.config import Pipeline, WorkerGroup, load_pipeline
from pdserve.cluster.launcher import Cluster, ClusterError
from pdserve.cluster.warmup_client import WarmupError, read_prompts
from pdserve.messages import ROLES
from pdserve.planner.config import AdaptiveConfig
from pdserve.schema import add_flags, flag_values, from_dict, nest


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="start router + workers and serve the OpenAI API")
    p.add_argument("--config", default=None, help="YAML file with Pipeline fields")
    for name in ROLES:
        p.add_argument(f"--{name}", type=int, default=None, help=f"number of {name} workers")
    add_flags(p, Pipeline)
    every_worker = p.add_argument_group("every worker (per role: the config file)")
    add_flags(every_worker, WorkerGroup, "role.")
    p.add_argument("--pin-cpus", action="store_true", help="one core per worker, in order")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run as Ray actors (placement: ray) on the cluster at ADDRESS, or on "
        "a new local Ray instance",
    )
    p.add_argument(
        "--warmup-file",
        default=None,
        help="prompts to prefill and pin once up: one per line, or .jsonl (warmup_prompts)",
    )
    p.add_argument(
        "--example-request",
        action="store_true",
        help="once up, send one chat request through the cluster and print it",
    )
    p.set_defaults(func=cmd_up)


def default_is_adaptive(args: argparse.Namespace, data: dict, role: dict) -> bool:
    """Without a file and role counts: an adaptive deployment (BENCHMARKS.md §10: it tracks
    collocated where a static split loses up to half), where one can run: on this host (not
    Ray), a core for each of its workers, and no cores or threads asked per worker (pinning,
    `--threads`: the planner sets those)."""
    workers = (data.get("adaptive") or {}).get("workers", AdaptiveConfig().workers)
    local = data.get("placement", "local") == "local"
    fixed = args.pin_cpus or "threads" in role or "cpus" in role
    return local and not fixed and len(os.sched_getaffinity(0)) >= workers


def pipeline_from_args(args: argparse.Namespace) -> Pipeline:
    """The config file's Pipeline (if any) with the flags applied; without a file and role
    counts, an adaptive deployment of two workers on every core (`default_is_adaptive`), else
    one prefill and one decode worker."""
    data = dataclasses.asdict(load_pipeline(args.config, {})) if args.config else {}
    top = flag_values(args, Pipeline)
    if args.ray is not None:
        top.update(placement="ray", **({"ray_address": args.ray} if args.ray else {}))
    if "api_key" not in top and envs.api_key():
        top["api_key"] = envs.api_key()
    if "admin_key" not in top and envs.admin_key():
        top["admin_key"] = envs.admin_key()
    nest(Pipeline, top, into=data)
    if args.warmup_file:
        try:
            data["warmup_prompts"] = read_prompts(args.warmup_file)
        except WarmupError as exc:
            raise ValueError(str(exc)) from None
    counts = {name: getattr(args, name) for name in ROLES}
    adaptive = (data.get("adaptive") or {}).get("enabled", False)
    role = flag_values(args, WorkerGroup, "role.")
    if not args.config and all(v is None for v in counts.values()) and not adaptive:
        adaptive = default_is_adaptive(args, data, role)
        if adaptive:
            data["adaptive"] = {**(data.get("adaptive") or {}), "enabled": True}
        else:
            counts.update(prefill=1, decode=1)
    if adaptive:
        if args.pin_cpus:
            raise ValueError("--pin-cpus: adaptive workers share one pool of cores (workers.cpus)")
        data["workers"] = {**(data.get("workers") or {}), **role}
    next_cpu = 0
    for name, num in counts.items():
        if num == 0 or (num is None and not data.get(name)):
            data[name] = None
            continue
        spec = {**(data.get(name) or {}), **role, **({"num": num} if num else {})}
        if args.pin_cpus:
            n = spec.get("num", 1)
            spec["cpus"] = [[c % os.cpu_count()] for c in range(next_cpu, next_cpu + n)]
            next_cpu += n
        data[name] = spec
    return from_dict(Pipeline, data, "flags")


def cmd_up(args: argparse.Namespace) -> int:
    pipeline = pipeline_from_args(args)
    log_level = logging.getLevelName(logging.getLogger().level)
    layout = ", ".join(f"{r.num} {n}" for n, r in pipeline.roles)
    if pipeline.adaptive.enabled:
        layout = f"{pipeline.adaptive.workers} adaptive workers on cores {pipeline.adaptive_cpus()}"
    print(f"pdserve: starting {layout} on {pipeline.model} ...", file=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell's `&` leaves it ignored
        signal.signal(sig, _interrupt)
    try:
        cluster = make_cluster(
            pipeline, log_level if log_level != "WARNING" else "INFO", report=_print_line
        )
        with cluster as url:
            print(f"pdserve: serving the OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
            if args.example_request:
                example_request(url, pipeline)
            while True:  # dead processes are restarted; a process that keeps dying ends it
                time.sleep(1)
                cluster.check_alive()
    except ClusterError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve: stopped", file=sys.stderr)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def make_cluster(pipeline: Pipeline, log_level: str, report=None) -> Cluster:
    """The launcher of the pipeline's placement; Ray is imported only for `ray`. `report`:
    where a local launcher's memory plan goes (Ray places workers on other nodes: none)."""
    if pipeline.placement == "ray":
        from pdserve.cluster.ray import RayCluster

        return RayCluster(pipeline, log_level)
    return Cluster(pipeline, log_level, report=report)


def _print_line(line: str) -> None:
    print(f"pdserve: {line}", file=sys.stderr, flush=True)


def example_request(url: str, pipeline: Pipeline) -> None:
    body = {
        "model": pipeline.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            **(
                {"Authorization": f"Bearer {pipeline.api_key.split(',')[0]}"}
                if pipeline.api_key
                else {}
            ),
        },
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    print(f"$ curl {url}/v1/chat/completions -d '{json.dumps(body)}'")
    print(
        f"-> {answer['choices'][0]['message']['content']!r} "
        f"({answer['usage']['completion_tokens']} tokens, {time.perf_counter() - t:.2f} s)",
        flush=True,
    )
