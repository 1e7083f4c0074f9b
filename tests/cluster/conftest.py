"""A real cluster (launcher, router, worker processes) on a tiny random-weight model that
carries a byte-level tokenizer, so end-to-end tests start in seconds."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port

KV_BYTES = 256 * 16 * 512  # 256 blocks of 16 tokens


def role(**kw) -> WorkerGroup:
    return WorkerGroup(kv_cache_bytes=KV_BYTES, threads=1, **kw)


def start(model: Path, **pipeline) -> Cluster:
    return Cluster(Pipeline(model=str(model), port=free_port(), **pipeline), log_level="WARNING")


def post(url: str, path: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_text(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return resp.read().decode()
