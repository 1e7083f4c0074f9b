"""The configuration tree. Frozen dataclasses, validated on construction; each part of the
system receives only the sub-config it needs. Values found at run time (the number of KV
blocks that fit, the model's context length) are returned by whoever finds them, never
written back here. Flags, YAML keys and checks derive from these fields (`pdserve.schema`,
docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvstore.config import KVStoreConfig
from pdserve.schema import check, knob, parse_bytes

CPU_KERNELS = ("native", "onednn", "torch")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. `kv_cache_bytes` wins over `kv_cache_memory_fraction` (a share of the
    device's free memory after the weights are loaded)."""

    block_size: int = knob(16, "tokens per KV block", gt=0)
    kv_cache_bytes: int | None = knob(None, "KV pool size per worker", gt=0, parse=parse_bytes)
    kv_cache_memory_fraction: float | None = knob(
        None, "KV pool as a share of free device memory", gt=0, lt=1
    )
    enable_prefix_caching: bool = knob(True, "reuse cached prompt blocks", flag="prefix_caching")
    kv_cache_dtype: str = knob(
        "auto",
        "KV storage: the model's dtype, or fp8 (E4M3) or int8 rows + per-token scales",
        choices=KV_CACHE_DTYPES,
    )
    # Token dropping: a request holding more KV than this frees its least-attended blocks,
    # keeping the first `kv_sink_tokens` and the last `kv_recent_tokens` (None: off).
    kv_budget_tokens: int | None = knob(None, "most KV tokens per request (token dropping)")
    kv_sink_tokens: int = knob(16, "first tokens token dropping always keeps")
    kv_recent_tokens: int = knob(64, "last tokens token dropping always keeps")
    # Cache warm-up: the most of the pool that pinned prompts may hold, so pins can never
    # starve running requests of blocks.
    max_pinned_fraction: float = knob(0.5, "most of the KV pool pinned prompts hold", ge=0, le=1)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits. A prompt longer than `long_prefill_token_threshold` is prefilled in
    chunks of that size, so one long prompt cannot stall the running decodes for long."""

    max_num_seqs: int = knob(64, "most requests running at once", gt=0)
    max_num_batched_tokens: int = knob(2048, "most tokens in one step", gt=0)
    long_prefill_token_threshold: int = knob(512, "prefill chunk size of long prompts", gt=0)
    max_model_len: int | None = knob(None, "context length (default: the model's)", gt=0)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class DeviceConfig:
    """Where the data plane runs. `threads` sets torch's intra-op threads (None: torch's
    default); on CUDA the device string names the GPU. `cpu_kernels` picks the CPU paths:
    "native" (oneDNN GEMMs plus pdserve's C kernels for small-batch linears and decode
    attention; falls back to "onednn" where they cannot be built), "onednn" (prepacked
    GEMMs, PyTorch attention) or "torch" (plain `F.linear` and SDPA, the reference)."""

    device: str = knob("cpu", "cpu or cuda[:N]", pattern=(r"cpu|cuda(:\d+)?", "cpu or cuda[:N]"))
    dtype: str = knob("float32", "weights and activations", choices=DTYPES)
    threads: int | None = knob(None, "torch intra-op threads per worker", gt=0)
    cpu_kernels: str = knob(
        "native", "CPU paths: native C kernels, oneDNN, or plain PyTorch", choices=CPU_KERNELS
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class EngineConfig:
    model: str = knob("smollm2-135m", "known name, .gguf file or HF directory")
    # The GGUF loading rule (model/gguf_convert.py): a file of F32/Q4_0/Q4_1/Q8_0 matrices
    # whose fp32 copy is at most this is converted to fp32 (lossless compact panels, tokens
    # as transformers'); every other file is read in place from its mapping (one copy a host).
    gguf_fp32_max_bytes: int = knob(
        2**30,
        "convert GGUF files of Q4_0/Q4_1/Q8_0 up to this fp32 size (0: none); "
        "larger ones and other types are read in place",
        ge=0,
        parse=parse_bytes,
    )
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    kvstore: KVStoreConfig = knob(KVStoreConfig(), "tiers below the pool", prefix="kv_")
    seed: int = knob(0, "engine seed for unseeded sampling")

    def __post_init__(self) -> None:
        check(self)
