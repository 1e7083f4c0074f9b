"""The worker memory estimate: parameter counts equal a real model's, checkpoints read from
HF directories and GGUF files alike, and each role's weight copies follow the CPU kernels."""

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.memory import (
    ACTIVATION_FACTOR,
    LOADED_FACTOR,
    PACKING_TRANSIENT_FACTOR,
    Checkpoint,
    estimate_worker,
    in_place_private_bytes,
    kv_pool_bytes,
    linear_shapes,
    read_checkpoint,
    weights_held,
)
from pdserve.model.config import ModelConfig
from pdserve.model.synthetic import SHAPES, file_bytes, write_synthetic_gguf
from tests.conftest import make_tiny_llama


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parameter_count_is_the_models(tmp_path, tied):
    from pdserve.model.loader import load_model

    model_dir = make_tiny_llama(tmp_path, tie_word_embeddings=tied)
    ckpt = read_checkpoint(str(model_dir))
    model = load_model(model_dir)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert ckpt.num_params == sum(unique.values())
    assert all(source is None for _, source in ckpt.linears)  # an HF checkpoint: fp32


def test_a_gguf_is_read_without_converting_it(tmp_path):
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q4_1")
    ckpt = read_checkpoint(str(path))
    shape = SHAPES["tiny"]
    assert (ckpt.config.hidden_size, ckpt.config.num_layers) == (256, shape.num_layers)
    assert ckpt.config.vocab_size == 49152 and ckpt.config.tie_word_embeddings
    types = dict.fromkeys(t for _, t in ckpt.linears)
    assert list(types) == ["Q4_1", "Q6_K"]  # the matrices, then the tied output (embedding)
    assert not list(tmp_path.glob("*/config.json"))  # nothing converted
    assert read_checkpoint(str(tmp_path / "missing.gguf")) is None
    # Its Q6_K embedding is read in place (gguf_convert.reads_in_place): the file's tensors
    # are mapped once per host, and a worker holds only its rope tables, norms and tile.
    assert ckpt.in_place_bytes == file_bytes(shape, "q4_1")
    holding = weights_held(ckpt, "decode", "native", amx=False)
    assert holding.shared_bytes == ckpt.in_place_bytes
    assert holding.private_bytes == in_place_private_bytes(ckpt.config)
    # Q8_0 alone stays on the converted fp32 path: nothing shared.
    q8 = read_checkpoint(str(write_synthetic_gguf(tmp_path / "q8.gguf", "tiny", "q8_0")))
    assert q8.in_place_bytes == 0 and weights_held(q8, "decode", "native", False).shared_bytes == 0
    # The loading rule's knob (gguf_fp32_max_bytes) reads it in place when it is past it.
    q8_in_place = read_checkpoint(str(tmp_path / "q8.gguf"), gguf_fp32_max_bytes=0)
    assert q8_in_place.in_place_bytes == file_bytes(shape, "q8_0")


def test_a_bf16_hf_checkpoint_is_mapped_not_copied(tmp_path):
    """A bf16 HF directory is read in place (safetensors_header.reads_in_place): its matrices
    count once per host, as a GGUF's do; an fp32 one stays a private copy."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    fp32_dir = make_tiny_llama(tmp_path / "fp32")
    assert read_checkpoint(str(fp32_dir)).in_place_bytes == 0
    model = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ckpt = read_checkpoint(str(tmp_path / "bf16"))
    matrices = sum(p.numel() * 2 for p in model.parameters() if p.dim() == 2)
    assert ckpt.in_place_bytes == matrices
    holding = weights_held(ckpt, "decode", "native", amx=False)
    assert holding.shared_bytes == matrices
    assert holding.private_bytes == in_place_private_bytes(ckpt.config)
    # A matrix widened to fp32 at load (an F64 one) is each worker's own, not shared.
    path, name = tmp_path / "bf16" / "model.safetensors", "model.layers.0.mlp.down_proj.weight"
    tensors = load_file(path)
    tensors[name] = tensors[name].double()
    save_file(tensors, path, metadata={"format": "pt"})
    ckpt, n = read_checkpoint(str(tmp_path / "bf16")), tensors[name].numel()
    assert ckpt.widened_bytes == 4 * n and ckpt.in_place_bytes == matrices - 2 * n
    holding = weights_held(ckpt, "decode", "native", amx=False)
    assert holding.private_bytes == in_place_private_bytes(ckpt.config) + 4 * n


def _ckpt(source: str | None) -> Checkpoint:
    cfg = ModelConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return Checkpoint(cfg, tuple((n, source) for _, n in linear_shapes(cfg)))


def test_weight_copies_follow_the_role_and_the_cpu_kernels():
    q4, fp32 = _ckpt("Q4_1"), _ckpt(None)
    linear = sum(n for n, _ in q4.linears)
    loaded = q4.fp32_bytes * (LOADED_FACTOR + PACKING_TRANSIENT_FACTOR)

    def copies(ckpt, kernels, cpu_kernels="native", amx=False):
        return weights_held(ckpt, kernels, cpu_kernels, amx).private_bytes - int(loaded)

    # AMX: compact panels are the only copy, in every role (0.75 bytes a Q4_1 weight).
    for kernels in ("prefill", "decode", "collocated"):
        assert copies(q4, kernels, amx=True) == pytest.approx(0.75 * linear, abs=1)
    # Elsewhere: decode keeps the panels, collocated and prefill both (prefill: compact ones).
    assert copies(q4, "prefill") == pytest.approx(4.75 * linear, abs=1)
    assert copies(fp32, "prefill") == pytest.approx(4 * linear, abs=1)
    assert copies(q4, "decode") == pytest.approx(0.75 * linear, abs=1)
    assert copies(q4, "collocated") == pytest.approx(4.75 * linear, abs=1)
    # An HF checkpoint's panels stay fp32, even on AMX, where prefill keeps oneDNN's.
    assert copies(fp32, "decode", amx=True) == pytest.approx(4 * linear, abs=1)
    assert copies(fp32, "prefill", amx=True) == pytest.approx(4 * linear, abs=1)
    # Plain PyTorch packs nothing; oneDNN alone keeps its copy in every role.
    assert weights_held(q4, "decode", "torch", True).private_bytes == int(
        q4.fp32_bytes * LOADED_FACTOR
    )
    assert copies(q4, "decode", "onednn", amx=True) == pytest.approx(4 * linear, abs=1)


def test_kv_pool_and_activations():
    ckpt = _ckpt("Q4_1")
    fixed = EngineConfig(cache=CacheConfig(kv_cache_bytes=3 << 20))
    assert kv_pool_bytes(fixed, 100 << 30) == 3 << 20
    assert kv_pool_bytes(EngineConfig(), 100 << 30) == 5 << 30  # 5% of what is available
    share = EngineConfig(cache=CacheConfig(kv_cache_memory_fraction=0.5))
    assert kv_pool_bytes(share, 8 << 30) == 4 << 30
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=1000))
    memory, holding = estimate_worker(ckpt, engine, "decode", 1 << 30, amx=False)
    assert memory.activations == 1000 * 64 * ACTIVATION_FACTOR
    assert memory.weights == holding.private_bytes and holding.shared_bytes == 0
    assert memory.total == memory.weights + memory.kv_pool + memory.activations + memory.base
