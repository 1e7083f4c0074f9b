"""The configuration tree. Frozen dataclasses, validated on construction; each part of the
system receives only the sub-config it needs. Values found at run time (the number of KV
blocks that fit, the model's context length) are returned by whoever finds them, never
written back here."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvstore.config import KVStoreConfig


def _positive(name: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. `kv_cache_bytes` wins over `kv_cache_memory_fraction` (a share of the
    device's free memory after the weights are loaded)."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": E4M3 + per-token scales
    # Token dropping: a request holding more KV than this frees its least-attended blocks,
    # keeping the first `kv_sink_tokens` and the last `kv_recent_tokens` (None: off).
    kv_budget_tokens: int | None = None
    kv_sink_tokens: int = 16
    kv_recent_tokens: int = 64
    # Cache warm-up: the most of the pool that pinned prompts may hold, so pins can never
    # starve running requests of blocks.
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        _positive("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits. A prompt longer than `long_prefill_token_threshold` is prefilled in
    chunks of that size, so one long prompt cannot stall the running decodes for long."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 512
    max_model_len: int | None = None  # None: the model's own context length

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold)
        _positive("max_model_len", self.max_model_len, allow_none=True)


CPU_KERNELS = ("native", "onednn", "torch")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the data plane runs. `threads` sets torch's intra-op threads (None: torch's
    default); on CUDA the device string names the GPU. `cpu_kernels` picks the CPU paths:
    "native" (oneDNN GEMMs plus pdserve's C kernels for small-batch linears and decode
    attention; falls back to "onednn" where they cannot be built), "onednn" (prepacked
    GEMMs, PyTorch attention) or "torch" (plain `F.linear` and SDPA, the reference)."""

    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    cpu_kernels: str = "native"

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        _positive("threads", self.threads, allow_none=True)
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    kvstore: KVStoreConfig = KVStoreConfig()  # tiers below the worker's pool; off by default
    seed: int = 0
