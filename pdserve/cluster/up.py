"""`pdserve up`: start a cluster from flags or a YAML file and serve until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import urllib.request

from pdserve.cluster.config import (
    POLICIES,
    Pipeline,
    Role,
    TensorStore,
    load_pipeline,
    pipeline_from_dict,
)

API_KEY_ENV = "PDSERVE_API_KEY"


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="start router + workers and serve the OpenAI API")
    p.add_argument("--config", default=None, help="YAML file with Pipeline fields")
    p.add_argument("--model", default=None)
    p.add_argument("--prefill", type=int, default=None, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=None, help="number of decode workers")
    p.add_argument("--collocated", type=int, default=None, help="collocated workers instead")
    p.add_argument("--transfer", choices=["auto", "shm", "tcp"], default=None)
    p.add_argument("--transfer-mode", choices=["layerwise", "full"], default=None)
    p.add_argument("--transfer-bandwidth", default=None, help="e.g. 10Gbit (emulated link)")
    p.add_argument("--routing", choices=POLICIES, default=None)
    p.add_argument("--load-balancer", choices=POLICIES, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--pin-cpus", action="store_true", help="one core per worker, in order")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="per worker")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default=None,
        help="KV storage of every worker (per role: the config file's field)",
    )
    p.add_argument("--kv-host-bytes", type=int, default=None, help="L2: host DRAM (shm) tier")
    p.add_argument("--kv-disk-dir", default=None, help="L3: local disk tier directory")
    p.add_argument("--kv-disk-bytes", type=int, default=None)
    p.add_argument("--kv-redis-url", default=None, help="L4: redis://host:port/db, or 'local'")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"or ${API_KEY_ENV}")
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


def pipeline_from_args(args: argparse.Namespace) -> Pipeline:
    top = {k: v for k, v in {
        "model": args.model, "host": args.host, "port": args.port, "api_key": args.api_key,
        "routing": args.routing, "load_balancer": args.load_balancer,
    }.items() if v is not None}  # fmt: skip
    store = {k: v for k, v in {
        "backend": args.transfer, "mode": args.transfer_mode, "bandwidth": args.transfer_bandwidth,
    }.items() if v is not None}  # fmt: skip
    role = {k: v for k, v in {
        "threads": args.threads, "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
    }.items() if v is not None}  # fmt: skip
    counts = {"prefill": args.prefill, "decode": args.decode, "collocated": args.collocated}
    if args.config:
        base = load_pipeline(args.config, {})
        data = {**_asdict(base), **top}
    else:
        data = dict(top)
        if all(v is None for v in counts.values()):
            counts = {"prefill": 1, "decode": 1, "collocated": None}
    if args.warmup_file:
        from pdserve.cluster.warmup import WarmupError, read_prompts

        try:
            data["warmup_prompts"] = read_prompts(args.warmup_file)
        except WarmupError as exc:
            raise ValueError(str(exc)) from None
    if store:
        data["kv_transfer"] = {**data.get("kv_transfer", {}), **store}
    pool = {k: v for k, v in {
        "host_bytes": args.kv_host_bytes, "disk_dir": args.kv_disk_dir,
        "disk_bytes": args.kv_disk_bytes, "redis_url": args.kv_redis_url,
    }.items() if v is not None}  # fmt: skip
    if pool:
        data["kv_pool"] = {**data.get("kv_pool", {}), **pool}
    next_cpu = 0
    for name, num in counts.items():
        if num is None and not (args.config and data.get(name)):
            continue
        if num == 0 or (num is None and not data.get(name)):
            data[name] = None
            continue
        spec = {**(data.get(name) or {}), **role, **({"num": num} if num else {})}
        if args.pin_cpus:
            n = spec.get("num", 1)
            spec["cpus"] = [[c % os.cpu_count()] for c in range(next_cpu, next_cpu + n)]
            next_cpu += n
        data[name] = spec
    return pipeline_from_dict(data)


def _asdict(p: Pipeline) -> dict:
    import dataclasses

    return dataclasses.asdict(p)


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.cluster.launcher import Cluster, ClusterError

    pipeline = pipeline_from_args(args)
    log_level = logging.getLevelName(logging.getLogger().level)
    layout = ", ".join(f"{r.num} {n}" for n, r in pipeline.roles)
    print(f"pdserve: starting {layout} on {pipeline.model} ...", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with Cluster(pipeline, log_level=log_level if log_level != "WARNING" else "INFO") as url:
            print(f"pdserve: serving the OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
            if args.example_request:
                example_request(url, pipeline)
            while True:
                time.sleep(1)
    except ClusterError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve: stopped", file=sys.stderr)
    return 0


def example_request(url: str, pipeline: Pipeline) -> None:
    body = {
        "model": pipeline.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {pipeline.api_key}"} if pipeline.api_key else {})},
    )  # fmt: skip
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    print(f"$ curl {url}/v1/chat/completions -d '{json.dumps(body)}'")
    print(f"-> {answer['choices'][0]['message']['content']!r} "
          f"({answer['usage']['completion_tokens']} tokens, {time.perf_counter() - t:.2f} s)",
          flush=True)  # fmt: skip


__all__ = ["Pipeline", "Role", "TensorStore", "add_up_parser"]
