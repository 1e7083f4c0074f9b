"""A worker's memory, estimated before it starts (the launcher's check,
cluster/memory_plan.py) from the model's config and checkpoint, without loading either.

A worker holds, at the peak of its start (when workers starting together coincide):

    interpreter, torch, pdserve        BASE_RSS_BYTES
  + the weights                        `weights_held()`: how the worker holds them
  + the KV pool                        `kv_pool_bytes()`: kv_cache_bytes, else a share of
                                       the memory available when it starts
  + activations of its largest step    max_num_batched_tokens x hidden x ACTIVATION_FACTOR

The weights are held one of two ways (`weights_held()`, `WeightHolding`):

- a GGUF the loading rule reads in place (gguf_convert.reads_in_place: any matrix outside
  the panel types, or an fp32 copy over `gguf_fp32_max_bytes`) is read from the mapped file
  (model/gguf_weights.py): its tensor bytes are `shared_bytes`, one page-cache copy counted
  once per host however many workers map it; a worker's own part is its rope tables, norms
  and the kernels' fp32 tile (`in_place_private_bytes()`);
- any other checkpoint is converted to fp32 safetensors, and each worker loads its own copy
  (LOADED_FACTOR x the fp32 bytes: the allocator keeps what the loader's fusing freed), then
  packs every linear layer for the CPU kernels (model/cpu_linear.py): a oneDNN copy (fp32) or
  native panels (0.75 or 1.125 bytes a weight for GGUF-born Q4_1 or Q4_0/Q8_0 matrices, which
  panel_codec.py stores losslessly, else fp32), or both, made while the loaded copy is still
  alive, plus PACKING_TRANSIENT_FACTOR x the fp32 bytes of buffers the packing frees again.

The factors were measured with /proc/self/status (VmHWM, VmRSS) on SmolLM2-135M (Q4_1) and a
Llama 3.2 1B-shaped file (`pdserve synth`); docs/observability.md ("Memory") compares the
estimate with what workers report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.model.config import ModelConfig

BASE_RSS_BYTES = 260 * 2**20  # a worker bar its model: Python, torch, oneDNN, zmq (238 MiB seen;
# a first grammar request imports transformers: ~20 MiB more)
LOADED_FACTOR = 1.22  # RSS of the loaded model over its fp32 bytes (1.21 at 135M, 1.22 at 1B)
PACKING_TRANSIENT_FACTOR = 0.55  # packing's freed buffers at the peak, x the fp32 bytes
ACTIVATION_FACTOR = 72  # step RSS growth in bytes per (batched token x hidden unit)
# The KV pool a worker sizes itself without kv_cache_bytes: a share of the memory available
# when it starts (model_runner.num_kv_blocks).
DEFAULT_CPU_KV_FRACTION = 0.05  # of available RAM: room for other workers on the host
DEFAULT_CUDA_KV_FRACTION = 0.8  # of free GPU memory after the weights are loaded
IN_PLACE_TILE_BYTES = 4 << 22  # quant_linear.TILE_FLOATS fp32 values (torch-free here)
# Bytes a weight of each GGUF type takes in native panels (panel_codec.py); others: fp32.
PANEL_BYTES = {"Q4_1": 0.75, "Q4_0": 1.125, "Q8_0": 1.125}


@dataclass(frozen=True)
class Checkpoint:
    """What the estimate needs of a model: its shape, and each linear layer's weight as
    (number of weights, the GGUF type it came from, or None for an HF checkpoint)."""

    config: ModelConfig
    linears: tuple[tuple[int, str | None], ...]
    # A GGUF whose matrices the loader reads in place from the mapped file
    # (gguf_convert.reads_in_place): the file's tensor bytes, else 0.
    in_place_bytes: int = 0
    # An HF checkpoint read in place: the fp32 bytes of its matrices widened at load
    # (safetensors_header.widened_bytes), each worker's own.
    widened_bytes: int = 0

    @property
    def num_params(self) -> int:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (2 * q_size + 2 * kv_size) + 3 * c.hidden_size * (
            c.intermediate_size
        )
        per_layer += 2 * c.hidden_size + (q_size + 2 * kv_size if c.attention_bias else 0)
        heads = 1 if c.tie_word_embeddings else 2
        return c.num_layers * per_layer + heads * c.vocab_size * c.hidden_size + c.hidden_size

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.num_params


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(llama.cpp name, number of weights) of every matrix a linear layer runs; the output
    layer is the embedding when tied."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    layer = [
        ("attn_q", q_size * h),
        ("attn_k", kv_size * h),
        ("attn_v", kv_size * h),
        ("attn_output", h * q_size),
        ("ffn_gate", ffn * h),
        ("ffn_up", ffn * h),
        ("ffn_down", h * ffn),
    ]
    out = [(f"blk.{i}.{name}.weight", n) for i in range(cfg.num_layers) for name, n in layer]
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    return [*out, (head, cfg.vocab_size * h)]


def read_checkpoint(
    model: str, gguf_fp32_max_bytes: int = EngineConfig.gguf_fp32_max_bytes
) -> Checkpoint | None:
    """The checkpoint facts of a known model name, a GGUF file (its metadata and tensor list
    only: nothing is converted or loaded; read in place or not by the loading rule and its
    knob) or an HF directory; None for a model that cannot be read (resolving it later says
    why)."""
    from pdserve.model.registry import KNOWN_MODELS, known_gguf_path

    try:
        path = known_gguf_path(model) if model in KNOWN_MODELS else Path(model).expanduser()
        widened = 0
        if path.is_dir():
            from pdserve.model.safetensors_header import in_place_bytes as mapped_bytes
            from pdserve.model.safetensors_header import widened_bytes

            config, types, in_place_bytes = ModelConfig.from_dir(path), {}, mapped_bytes(path)
            widened = widened_bytes(path)
        elif path.is_file() and path.suffix == ".gguf":
            config, types, in_place_bytes = _gguf_facts(path, gguf_fp32_max_bytes)
        else:
            return None
    except ValueError:
        return None
    linears = tuple((n, types.get(name)) for name, n in linear_shapes(config))
    return Checkpoint(config, linears, in_place_bytes, widened)


def _gguf_facts(path: Path, fp32_max_bytes: int) -> tuple[ModelConfig, dict[str, str], int]:
    """A GGUF file's model config (as its conversion writes it), each tensor's type, and its
    tensor bytes if the loader reads them in place (else 0)."""
    from gguf import GGML_QUANT_SIZES

    from pdserve.model.gguf_convert import build_config, reads_in_place
    from pdserve.model.gguf_header import read_header

    metadata, tensors = read_header(path)
    config = ModelConfig.from_hf(build_config(metadata, tensors, path))
    types = {t.name: t.tensor_type.name for t in tensors}
    if not reads_in_place(tensors, fp32_max_bytes):
        return config, types, 0
    in_place = 0
    for t in tensors:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        in_place += math.prod(t.shape) // block * type_size
    return config, types, in_place


@dataclass(frozen=True)
class WeightHolding:
    """How a worker holds the weights: `private_bytes` are its own (at the peak of its
    start), `shared_bytes` are mapped from one file and counted once per host."""

    private_bytes: int
    shared_bytes: int = 0


def weights_held(ckpt: Checkpoint, kernels: str, cpu_kernels: str, amx: bool) -> WeightHolding:
    """Today's: a private fp32 copy, and the packed copies `kernels` (a role name: which
    linear kernels the worker prepares) makes beside it (module docstring). `amx`: the AMX
    kernels run, whose compact panels are the only copy in every role."""
    if ckpt.in_place_bytes:
        private = in_place_private_bytes(ckpt.config) + ckpt.widened_bytes
        return WeightHolding(private, ckpt.in_place_bytes)
    fp32 = ckpt.fp32_bytes
    if cpu_kernels == "torch":
        return WeightHolding(int(fp32 * LOADED_FACTOR))
    copies = 0.0
    for n, source_type in ckpt.linears:
        compact = PANEL_BYTES.get(source_type or "") if cpu_kernels == "native" else None
        if compact is not None and amx:
            copies += n * compact  # compact panels alone, in every role
            continue
        # A prefill worker keeps compact panels for short chunks, fp32 ones not (cpu_linear.py).
        panels = cpu_kernels == "native" and (kernels != "prefill" or compact is not None)
        onednn = kernels != "decode" or not panels
        copies += n * ((compact or 4) if panels else 0) + n * (4 if onednn else 0)
    peak = fp32 * (LOADED_FACTOR + PACKING_TRANSIENT_FACTOR) + copies
    return WeightHolding(int(peak))


def in_place_private_bytes(cfg: ModelConfig) -> int:
    """What a worker of an in-place GGUF holds of its own: the rope tables (cos and sin,
    [max_position_embeddings, head_dim] fp32 each), the norms, and the kernels' fp32 tile
    (quant_linear.TILE_FLOATS)."""
    rope = 2 * cfg.max_position_embeddings * cfg.head_dim * 4
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    return rope + norms + IN_PLACE_TILE_BYTES


def kv_pool_bytes(engine: EngineConfig, available_bytes: int) -> int:
    """The KV pool a worker of `engine` allocates on a host with `available_bytes` free."""
    if engine.cache.kv_cache_bytes is not None:
        return engine.cache.kv_cache_bytes
    on_cuda = engine.device.device.startswith("cuda")
    fraction = engine.cache.kv_cache_memory_fraction or (
        DEFAULT_CUDA_KV_FRACTION if on_cuda else DEFAULT_CPU_KV_FRACTION
    )
    return int(available_bytes * fraction)


def meminfo_available_bytes() -> int:
    """/proc/meminfo's MemAvailable: what the host can give without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def activation_bytes(cfg: ModelConfig, engine: EngineConfig) -> int:
    return engine.scheduler.max_num_batched_tokens * cfg.hidden_size * ACTIVATION_FACTOR


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's estimate, in bytes; `weights` is its private part."""

    weights: int
    kv_pool: int
    activations: int
    base: int = BASE_RSS_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.activations + self.base


def estimate_worker(
    ckpt: Checkpoint,
    engine: EngineConfig,
    kernels: str,
    available_bytes: int,
    amx: bool,
) -> tuple[WorkerMemory, WeightHolding]:
    """A worker's estimate, and how it holds the weights (the shared part counts once)."""
    holding = weights_held(ckpt, kernels, engine.device.cpu_kernels, amx)
    memory = WorkerMemory(
        weights=holding.private_bytes,
        kv_pool=kv_pool_bytes(engine, available_bytes),
        activations=activation_bytes(ckpt.config, engine),
    )
    return memory, holding
