"""Every environment variable pdserve reads, named and read here and nowhere else.

Secrets travel in the environment rather than on a command line, where `ps` would show them;
the launcher builds each child's environment with `child_env`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLUSTER_SECRET = "PDSERVE_CLUSTER_SECRET"  # hex; set by the launcher for router and workers
API_KEY = "PDSERVE_API_KEY"  # the `/v1` bearer key (`pdserve up`, router)
ADMIN_KEY = "PDSERVE_ADMIN_KEY"  # the cache warm-up key (`pdserve up`, `pdserve warmup`, router)
# The L4 Redis password when redis_url has none (the launcher's own Redis: generated).
REDIS_PASSWORD = "PDSERVE_REDIS_PASSWORD"
CACHE_DIR = "PDSERVE_CACHE_DIR"  # converted models and built kernels (~/.cache/pdserve/models)
NATIVE_KERNELS = "PDSERVE_NATIVE_KERNELS"  # "0": never build or load the C kernels
CPU_ISA = "PDSERVE_CPU_ISA"  # the C kernels' variant: auto (the widest) or a native.ISA_FLAGS key
C_COMPILER = "CC"  # the compiler for the native kernels (gcc)
# A folder: each worker appends every engine step it runs (its shape, threads, start and
# duration) to `<folder>/<worker id>.steps.jsonl` (workers/step_report.py, `StepTrace`), for
# comparing served steps with a profile (`benchmarks/served_steps.py`). Unset: no trace.
STEP_TRACE = "PDSERVE_STEP_TRACE"
# Where this process runs, for the transfer channel: shm only between peers with equal ids
# (and then only where the receiver's segment is seen). Default: hostname + boot id.
HOST_ID = "PDSERVE_HOST_ID"
# Ray's own: the cluster `ray.init(address="auto")` joins (set inside a Ray job).
RAY_ADDRESS = "RAY_ADDRESS"
# Bytes the launcher's memory plan takes as this host's available memory instead of
# MemAvailable and the cgroup limit (cluster/memory_plan.py), e.g. "16GiB" to leave the rest
# to other services.
MEMORY_AVAILABLE = "PDSERVE_MEMORY_AVAILABLE"
# OpenMP's wait policy (libgomp, which torch's CPU wheels ship): an operator's value wins over
# the worker default below.
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
# How long an idle OpenMP thread of a worker spins before it sleeps, in spins (a PAUSE each,
# 40-80 ns on the Xeon of docs/cpu-kernels.md). libgomp's default, 300,000 (12-24 ms), keeps
# every core busy through each step's Python work and the gap between tokens, so the router
# and the client preempt a thread that computes and the next parallel region waits a time
# slice for it. 1,000 (40-80 us) still spans the gaps between a step's parallel regions.
WORKER_SPINCOUNT = "1000"


def cluster_secret() -> bytes:
    value = os.environ.get(CLUSTER_SECRET, "")
    if not value:
        raise ValueError(f"{CLUSTER_SECRET} must hold the cluster secret as hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{CLUSTER_SECRET} is not valid hex") from None


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def admin_key() -> str | None:
    return os.environ.get(ADMIN_KEY) or None


def redis_password() -> str | None:
    return os.environ.get(REDIS_PASSWORD) or None


def step_trace_dir() -> Path | None:
    value = os.environ.get(STEP_TRACE)
    return Path(value).expanduser() if value else None


@contextmanager
def step_trace(folder: Path) -> Iterator[None]:
    """Processes started meanwhile trace their steps to `folder` (`STEP_TRACE`); the variable
    is as it was afterwards."""
    before = os.environ.get(STEP_TRACE)
    os.environ[STEP_TRACE] = str(folder)
    try:
        yield
    finally:
        if before is None:
            del os.environ[STEP_TRACE]
        else:
            os.environ[STEP_TRACE] = before


def cache_dir() -> Path:
    value = os.environ.get(CACHE_DIR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pdserve" / "models"


def host_id() -> str | None:
    return os.environ.get(HOST_ID) or None


def ray_address() -> str | None:
    return os.environ.get(RAY_ADDRESS) or None


def memory_available_bytes() -> int | None:
    value = os.environ.get(MEMORY_AVAILABLE)
    if not value:
        return None
    from pdserve.schema import parse_bytes

    try:
        return parse_bytes(value)
    except argparse.ArgumentTypeError:
        raise ValueError(f"{MEMORY_AVAILABLE}={value!r} is not a size (e.g. 16GiB)") from None


def native_kernels_allowed() -> bool:
    return os.environ.get(NATIVE_KERNELS, "1") != "0"


def cpu_isa() -> str:
    return os.environ.get(CPU_ISA, "auto")


def c_compiler() -> str:
    return os.environ.get(C_COMPILER, "gcc")


def set_worker_thread_wait() -> None:
    """Give a worker process pdserve's OpenMP spin count unless the operator set a wait
    policy; must run before torch is imported (libgomp reads it when it loads)."""
    if OMP_WAIT_POLICY not in os.environ and GOMP_SPINCOUNT not in os.environ:
        os.environ[GOMP_SPINCOUNT] = WORKER_SPINCOUNT


def thread_wait() -> dict[str, str]:
    """This process's OpenMP wait-policy variables that are set (what libgomp reads)."""
    return {
        name: os.environ[name] for name in (OMP_WAIT_POLICY, GOMP_SPINCOUNT) if name in os.environ
    }


def child_env(
    secret: bytes,
    api_key: str | None = None,
    admin_key: str | None = None,
    redis_password: str | None = None,
) -> dict[str, str]:
    """This process's environment plus the cluster secret (and the keys, for the router; the
    Redis password, for workers)."""
    env = {**os.environ, CLUSTER_SECRET: secret.hex()}
    pairs = ((API_KEY, api_key), (ADMIN_KEY, admin_key), (REDIS_PASSWORD, redis_password))
    for name, value in pairs:
        if value:
            env[name] = value
    return env
