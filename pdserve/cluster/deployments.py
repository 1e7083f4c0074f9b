"""Named deployments for `pdserve bench compare`, started by the launcher.

Both built-in layouts use the same cores, so a comparison is at equal hardware:

    collocated   1 collocated worker on every core (torch threads = cores)
    1p1d         1 prefill worker on core 0 and 1 decode worker on core 1, 1 thread each
    NpMd         N prefill and M decode workers, one core each (needs N + M cores)
    adaptive     2 adaptive workers sharing every core; the planner moves cores between them

A spec may also be a URL (an already-running server, e.g. llama.cpp's) or a YAML file with
Pipeline fields.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from pdserve.cluster.config import Pipeline, WorkerGroup, load_pipeline
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.planner.config import AdaptiveConfig

DEFAULT_DEPLOYMENTS = {"collocated": "collocated", "1p1d": "1p1d"}


def pipeline_for(spec: str, model: str, kv_cache_bytes: int | None = None) -> Pipeline:
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    if spec == "collocated":
        role = WorkerGroup(cpus=tuple(cores), threads=len(cores), kv_cache_bytes=kv_cache_bytes)
        return Pipeline(model=model, collocated=role, port=port)
    if spec == "adaptive":
        workers = WorkerGroup(cpus=tuple(cores), kv_cache_bytes=kv_cache_bytes)
        return Pipeline(
            model=model, adaptive=AdaptiveConfig(enabled=True), workers=workers, port=port
        )
    match = re.fullmatch(r"(\d+)p(\d+)d", spec)
    if match:
        num_p, num_d = int(match[1]), int(match[2])
        if num_p + num_d > len(cores):
            raise ValueError(f"deployment {spec!r} needs {num_p + num_d} cores, have {len(cores)}")
        one_each = [[c] for c in cores]

        def role(first: int, n: int) -> WorkerGroup:
            return WorkerGroup(
                num=n, cpus=one_each[first : first + n], threads=1, kv_cache_bytes=kv_cache_bytes
            )

        return Pipeline(model=model, prefill=role(0, num_p), decode=role(num_p, num_d), port=port)
    if spec.endswith((".yaml", ".yml")):
        return load_pipeline(spec, {"port": port})
    raise ValueError(
        f"unknown deployment {spec!r}: use a URL, 'collocated', 'NpMd' (e.g. 1p1d), 'adaptive' "
        "or a .yaml file"
    )


def cluster_launcher(model: str, kv_cache_bytes: int | None = None):
    """The `launch` hook of `bench compare`: spec -> context manager yielding a base URL."""

    @contextlib.contextmanager
    def launch(spec: str) -> Iterator[str]:
        if spec.startswith(("http://", "https://")):
            yield spec
            return
        with Cluster(pipeline_for(spec, model, kv_cache_bytes), log_level="WARNING") as url:
            yield url

    return launch
