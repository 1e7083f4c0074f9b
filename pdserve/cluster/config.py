"""A deployment: which workers with which roles, how KV moves, how requests are routed.

One frozen tree, from CLI flags, a YAML file (same field names) or Python:

    Pipeline(prefill=WorkerGroup(num=1, cpus=[0], threads=1),
             decode=WorkerGroup(num=1, cpus=[1], threads=1),
             kv_transfer=KVTransferConfig(backend="auto", mode="layerwise"))

`routing` picks the prefill worker for a request, `load_balancer` the decode worker (for a
collocated deployment, `routing` picks the worker). A `WorkerGroup` holds the engine settings of its
workers under their `EngineConfig` names (block_size, threads, kv_cache_bytes, ...).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import envs
from pdserve.cluster.warmup_client import WarmupError, check_prompt
from pdserve.config import DTYPES, CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.kvstore.config import KVStoreConfig
from pdserve.messages import ROLES
from pdserve.model.cpu_flags import has_fast_bf16
from pdserve.planner.config import AdaptiveConfig
from pdserve.router.config import RouterConfig
from pdserve.schema import check, from_dict, from_flat, knob, same_as, with_fields_of
from pdserve.transfer import KVTransferConfig

PLACEMENTS = ("local", "ray")
MEMORY_CHECKS = ("off", "warn", "enforce")  # cluster/memory_plan.py


@with_fields_of(CacheConfig, SchedulerConfig, DeviceConfig, skip=("dtype",))
class WorkerGroup:
    """Workers of one role. `cpus` is one core list shared by all of them, or one list per
    worker (`[[0], [1]]`); on one host this is the "separate core groups" form of
    disaggregation. On GPUs, `device` names each worker's device ("cuda:0"). Token dropping:
    disaggregated, the decode role's `kv_budget_tokens` is the one that counts (a prompt over
    it is dropped on the prefill worker before the transfer)."""

    num: int = knob(1, "workers of this role", ge=1, cli=False)
    cpus: tuple = knob((), "cores: one list for all workers, or one list each", cli=False)
    # Under Ray placement (pdserve/cluster/ray.py), what each worker's actor asks of a node.
    ray_num_cpus: float | None = knob(None, "Ray CPUs per worker (default: threads, or 1)", ge=0)
    ray_num_gpus: float = knob(0.0, "Ray GPUs per worker", ge=0)
    ray_resources: dict | None = knob(
        None, "custom Ray resources per worker, e.g. a node pool {prefill_pool: 1}", cli=False
    )
    # Per-role precision, e.g. a bf16 prefill role feeding an fp32 decode role (the KV is
    # converted on the prefill side before the wire).
    dtype: str | None = knob(
        None,
        "this role's dtype (default: the pipeline's); auto: bfloat16 where the CPU has "
        "AMX or AVX512_BF16, else the pipeline's",
        choices=(*DTYPES, "auto"),
        cli=False,
    )

    def __post_init__(self) -> None:
        check(self)
        cpus = tuple(tuple(c) if isinstance(c, (list, tuple)) else c for c in self.cpus)
        object.__setattr__(self, "cpus", cpus)
        nested = [isinstance(c, tuple) for c in cpus]
        if any(nested) and (not all(nested) or len(cpus) != self.num):
            raise ValueError(f"cpus must be one core list or {self.num} lists, got {self.cpus!r}")
        bad = [
            (k, v)
            for k, v in (self.ray_resources or {}).items()
            if not isinstance(k, str) or type(v) not in (int, float) or v < 0
        ]
        if bad:
            raise ValueError(f"ray_resources must map names to amounts >= 0, got {bad[0]}")

    def cpus_of(self, index: int) -> tuple[int, ...]:
        if self.cpus and isinstance(self.cpus[0], tuple):
            return self.cpus[index]
        return self.cpus

    def dtype_of(self, pipeline_dtype: str) -> str:
        """This role's dtype on this host (`auto` is resolved here, by the launcher)."""
        if self.dtype == "auto":
            return "bfloat16" if has_fast_bf16() else pipeline_dtype
        return self.dtype or pipeline_dtype

    def engine_config(self, p: Pipeline, kvstore: KVStoreConfig) -> EngineConfig:
        """The EngineConfig of each worker of this role in pipeline `p` (its model, dtype)."""
        names = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in _PLACEMENT_FIELDS and f.name != "dtype"
        ]
        values = {n: getattr(self, n) for n in names}
        model = {"model": p.model, "gguf_fp32_max_bytes": p.gguf_fp32_max_bytes}
        engine = from_flat(EngineConfig, {**values, **model, "dtype": self.dtype_of(p.dtype)})
        return dataclasses.replace(engine, kvstore=kvstore)


_PLACEMENT_FIELDS = ("num", "cpus", "ray_num_cpus", "ray_num_gpus", "ray_resources")


@dataclass(frozen=True)
class Pipeline:
    model: str = same_as(EngineConfig, "model")
    gguf_fp32_max_bytes: int = same_as(EngineConfig, "gguf_fp32_max_bytes")
    prefill: WorkerGroup | None = None
    decode: WorkerGroup | None = None
    collocated: WorkerGroup | None = None
    kv_transfer: KVTransferConfig = knob(KVTransferConfig(), prefix="transfer_")
    # Declared once, on the router (RouterConfig.policy), so up, the router and simulate agree.
    routing: str = same_as(RouterConfig, "policy")
    load_balancer: str = same_as(RouterConfig, "load_balancer")
    host: str = knob("127.0.0.1", "the API's address")
    port: int = knob(8000, "the API's port", ge=0, le=65535)
    api_key: str | None = knob(
        None,
        f"bearer key for /v1, or several separated by commas, one per tenant (or ${envs.API_KEY})",
        repr=False,
    )
    cache_scope: str = same_as(RouterConfig, "cache_scope")
    admin_key: str | None = knob(
        None,
        f"bearer key for /v1/cache/warmup (or ${envs.ADMIN_KEY}; default: a random one)",
        repr=False,
    )
    dtype: str = same_as(DeviceConfig, "dtype")
    startup_timeout_s: float = knob(600.0, "wait this long for the workers", gt=0)
    # Before starting anything, each worker's weights + KV pool + activations against the
    # host's available memory (cluster/memory_plan.py): refuse a layout that cannot fit.
    memory_check: str = knob(
        "enforce",
        "refuse (enforce), warn about or skip (off) a layout that does not fit this host's memory",
        choices=MEMORY_CHECKS,
    )
    # Tiers below each worker's pool. `redis_url: local` has the launcher start a private
    # redis-server (Debian's package) for a one-host cluster.
    kv_pool: KVStoreConfig = knob(KVStoreConfig(), prefix="kv_")
    # Adaptive: `adaptive.workers` workers share one pool of cores and the planner gives them
    # roles and cores; `workers` holds their engine settings and the pool (`cpus`, default:
    # the launcher's cores), and no role is given.
    adaptive: AdaptiveConfig = knob(AdaptiveConfig(), prefix="adaptive_")
    workers: WorkerGroup | None = None
    # Prompts (text, or chat message lists) the launcher prefills and pins on every prefill
    # and collocated worker once the cluster is healthy, e.g. the deployment's system prompts.
    warmup_prompts: tuple = knob((), "prompts to prefill and pin once up", cli=False)
    # Warm them in the shared cache scope, hit by every tenant (docs/tiers.md, "Cache scopes").
    warmup_shared: bool = knob(False, "warmup_prompts serve every tenant (shared cache scope)")
    # Where the processes run: `local` (this host, the embedded launcher) or `ray` (actors on
    # a Ray cluster, docs/cluster.md). `ray_address`: None starts a local Ray instance.
    placement: str = knob("local", "this host, or actors on a Ray cluster", choices=PLACEMENTS)
    ray_address: str | None = knob(None, "the Ray cluster (auto, host:port, ray://...)")
    ray_timeout_s: float = knob(60.0, "wait this long to reach Ray and place each actor", gt=0)
    ray_max_restarts: int = knob(4, "Ray restarts of a dead actor (-1: always)", ge=-1)

    def __post_init__(self) -> None:
        check(self)
        object.__setattr__(self, "warmup_prompts", _warmup_prompts(self.warmup_prompts))
        tenants = self.api_key and self.cache_scope == "tenant"
        if self.warmup_prompts and tenants and not self.warmup_shared:
            raise ValueError(
                "warmup_prompts would serve no request: with api_key and cache_scope tenant "
                "every request has its key's scope; set warmup_shared (every tenant hits "
                "them) or cache_scope shared"
            )
        if self.adaptive.enabled:
            self._check_adaptive()
            return
        if self.workers is not None:
            raise ValueError("workers: only an adaptive pipeline has them (set adaptive.enabled)")
        disagg = self.prefill is not None or self.decode is not None
        if disagg and (self.prefill is None or self.decode is None):
            raise ValueError("a disaggregated pipeline needs both prefill and decode workers")
        if disagg == (self.collocated is not None):
            raise ValueError("give either prefill + decode workers or collocated workers")

    def _check_adaptive(self) -> None:
        for name in ROLES:
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}: an adaptive pipeline's planner gives the roles "
                    "(the workers' settings go in `workers`)"
                )
        w = self.workers or WorkerGroup()
        if w.num != 1:
            raise ValueError("workers.num: an adaptive pipeline has adaptive.workers workers")
        if w.threads is not None:
            raise ValueError("workers.threads: the planner sets an adaptive worker's threads")
        if any(isinstance(c, tuple) for c in w.cpus):
            raise ValueError(
                f"workers.cpus must be one core list, the pool all adaptive "
                f"workers share, got {w.cpus!r}"
            )
        self.adaptive_cpus()

    def adaptive_cpus(self) -> tuple[int, ...]:
        """The pool of cores an adaptive pipeline's workers share: `workers.cpus`, else this
        process's cores. ValueError if it cannot hold a core per worker."""
        cpus = self.workers.cpus if self.workers and self.workers.cpus else None
        pool = cpus or tuple(sorted(os.sched_getaffinity(0)))
        if len(pool) < self.adaptive.workers:
            where = "workers.cpus" if cpus else "this machine's cores"
            raise ValueError(
                f"adaptive.workers: {self.adaptive.workers} workers need a core "
                f"each, the pool ({where}) has {len(pool)}: {list(pool)}"
            )
        return pool

    @property
    def roles(self) -> list[tuple[str, WorkerGroup]]:
        return [(n, r) for n in ROLES if (r := getattr(self, n))]


def _warmup_prompts(value: tuple) -> tuple:
    try:
        return tuple(
            p if isinstance(p, str) else tuple(p)
            for p in (check_prompt(v, f"warmup_prompts[{i}]") for i, v in enumerate(value))
        )
    except WarmupError as exc:
        raise ValueError(str(exc)) from None


def load_pipeline(path: str | Path, overrides: dict[str, Any]) -> Pipeline:
    """A Pipeline from a YAML file; `overrides` replace its top-level fields."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping of fields")
    return from_dict(Pipeline, {**data, **overrides}, Path(path).name)
