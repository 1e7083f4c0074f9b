"""A deployment: which workers with which roles, how KV moves, how requests are routed.

One frozen tree, from CLI flags, a YAML file (same field names) or Python:

    Pipeline(prefill=Role(num=1, cpus=[0], threads=1), decode=Role(num=1, cpus=[1], threads=1),
             kv_transfer=TensorStore(backend="auto", mode="layerwise"))

`routing` picks the prefill worker for a request, `load_balancer` the decode worker (for a
collocated deployment, `routing` picks the worker).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config import CPU_KERNELS
from pdserve.kvstore.config import KVStoreConfig
from pdserve.transfer.bandwidth import parse_bandwidth

BACKENDS = ("auto", "shm", "tcp")
MODES = ("layerwise", "full")
POLICIES = ("round_robin", "shortest_queue", "prefix_cache")


@dataclass(frozen=True)
class Role:
    """Workers of one role. `cpus` is one core list shared by all of them, or one list per
    worker (`[[0], [1]]`); on one host this is the "separate core groups" form of
    disaggregation. On GPUs, `device` names each worker's device ("cuda:0")."""

    num: int = 1
    cpus: tuple = ()
    threads: int | None = None
    device: str = "cpu"
    cpu_kernels: str = "native"  # "onednn" / "torch": see DeviceConfig
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 512
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "fp8": E4M3 with per-token scales
    # Token dropping (CacheConfig). Disaggregated, the decode role's budget is the one that
    # counts: a prompt over it is dropped on the prefill worker before the transfer.
    kv_budget_tokens: int | None = None
    kv_sink_tokens: int = 16
    kv_recent_tokens: int = 64
    max_pinned_fraction: float = 0.5  # most of each worker's pool warm-up may pin

    def __post_init__(self) -> None:
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction!r}"
            )
        if isinstance(self.num, bool) or not isinstance(self.num, int) or self.num < 1:
            raise ValueError(f"num must be a positive integer, got {self.num!r}")
        cpus = tuple(tuple(c) if isinstance(c, (list, tuple)) else c for c in self.cpus or ())
        object.__setattr__(self, "cpus", cpus)
        nested = [isinstance(c, tuple) for c in cpus]
        if any(nested) and (not all(nested) or len(cpus) != self.num):
            raise ValueError(f"cpus must be one core list or {self.num} lists, got {self.cpus!r}")

    def cpus_of(self, index: int) -> tuple[int, ...]:
        if self.cpus and isinstance(self.cpus[0], tuple):
            return self.cpus[index]
        return self.cpus


@dataclass(frozen=True)
class TensorStore:
    """The KV transfer channel. `bandwidth` (e.g. "10Gbit") caps the sender with a token
    bucket, to emulate a cluster network on one host; `buffer_pool_size` bounds staging
    memory (bytes)."""

    backend: str = "auto"
    mode: str = "layerwise"
    buffer_pool_size: int = 64 * 2**20
    bandwidth: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kv_transfer.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.mode not in MODES:
            raise ValueError(f"kv_transfer.mode must be one of {MODES}, got {self.mode!r}")
        if self.bandwidth is not None:
            parse_bandwidth(self.bandwidth)


@dataclass(frozen=True)
class Pipeline:
    model: str = "smollm2-135m"
    prefill: Role | None = None
    decode: Role | None = None
    collocated: Role | None = None
    kv_transfer: TensorStore = TensorStore()
    routing: str = "prefix_cache"
    load_balancer: str = "shortest_queue"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    dtype: str = "float32"
    startup_timeout_s: float = 600.0
    # Tiers below each worker's pool. `redis_url: local` has the launcher start a private
    # redis-server (Debian's package) for a one-host cluster.
    kv_pool: KVStoreConfig = KVStoreConfig()
    # Prompts (text, or chat message lists) the launcher prefills and pins on every prefill
    # and collocated worker once the cluster is healthy, e.g. the deployment's system prompts.
    warmup_prompts: tuple = ()

    def __post_init__(self) -> None:
        disagg = self.prefill is not None or self.decode is not None
        if disagg and (self.prefill is None or self.decode is None):
            raise ValueError("a disaggregated pipeline needs both prefill and decode workers")
        if disagg == (self.collocated is not None):
            raise ValueError("give either prefill + decode workers or collocated workers")
        for name in ("routing", "load_balancer"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        object.__setattr__(self, "warmup_prompts", _warmup_prompts(self.warmup_prompts))

    @property
    def roles(self) -> list[tuple[str, Role]]:
        return [(n, r) for n in ("prefill", "decode", "collocated") if (r := getattr(self, n))]


def _warmup_prompts(value: Any) -> tuple:
    from pdserve.cluster.warmup import WarmupError, check_prompt

    if not isinstance(value, (list, tuple)):
        raise ValueError(f"warmup_prompts must be a list of prompts, got {value!r:.80}")
    try:
        return tuple(
            p if isinstance(p, str) else tuple(p)
            for p in (check_prompt(v, f"warmup_prompts[{i}]") for i, v in enumerate(value))
        )
    except WarmupError as exc:
        raise ValueError(str(exc)) from None


def pipeline_from_dict(data: dict[str, Any]) -> Pipeline:
    """A Pipeline from YAML/JSON data; unknown fields are named in the error."""
    known = {f.name for f in dataclasses.fields(Pipeline)}
    _no_unknown("config", data, known)
    kwargs = dict(data)
    for name in ("prefill", "decode", "collocated"):
        if kwargs.get(name) is not None:
            _no_unknown(name, kwargs[name], {f.name for f in dataclasses.fields(Role)})
            kwargs[name] = Role(**kwargs[name])
    if "kv_pool" in kwargs:
        known = {f.name for f in dataclasses.fields(KVStoreConfig)}
        _no_unknown("kv_pool", kwargs["kv_pool"], known)
        kwargs["kv_pool"] = KVStoreConfig(**kwargs["kv_pool"])
    if "kv_transfer" in kwargs:
        _no_unknown(
            "kv_transfer", kwargs["kv_transfer"], {f.name for f in dataclasses.fields(TensorStore)}
        )
        kwargs["kv_transfer"] = TensorStore(**kwargs["kv_transfer"])
    return Pipeline(**kwargs)


def load_pipeline(path: Path, overrides: dict[str, Any]) -> Pipeline:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping of fields")
    data.update(overrides)
    return pipeline_from_dict(data)


def _no_unknown(where: str, data: Any, known: set[str]) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown field(s) in {where}: {', '.join(unknown)}")
