"""The fused decoder layer (native kernels) equals the PyTorch reference layer."""

import pytest
import torch

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.model import native
from pdserve.model.cpu_fused import FusedDecoderLayer, fuse_layers
from pdserve.model.loader import load_model
from tests.engine.test_engine import prompts, run
from tests.model.test_llama import our_logits

lib = native.load()
pytestmark = pytest.mark.skipif(lib is None, reason="native CPU kernels unavailable here")


def test_fused_prefill_logits_equal_reference(tiny_model_dir):
    ids = [3, 17, 99, 4, 56, 2, 81, 33, 7, 120, 64, 5, 9]
    model = load_model(tiny_model_dir)
    want = our_logits(model, ids)
    assert fuse_layers(model, lib) == 2
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.layers)
    torch.testing.assert_close(our_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def engine(model_dir, kernels: str, **sched) -> Engine:
    cache = CacheConfig(block_size=4, kv_cache_bytes=256 * 4 * 512)
    return Engine(
        EngineConfig(
            model="tiny",
            cache=cache,
            scheduler=SchedulerConfig(**sched),
            device=DeviceConfig(cpu_kernels=kernels),
        ),
        model_dir=model_dir,
    )


def test_native_engine_equals_torch_engine(tiny_model_dir):
    """Mixed steps (decodes next to prefill chunks), batches of 1 to 8 decodes, prefix hits."""
    fast = engine(
        tiny_model_dir, "native", max_num_batched_tokens=24, long_prefill_token_threshold=8
    )
    assert isinstance(fast.runner.model.layers[0], FusedDecoderLayer)
    assert fast.runner.model.layers[0].one_call  # decode-only steps: one native call a layer
    slow = engine(tiny_model_dir, "torch")
    assert not isinstance(slow.runner.model.layers[0], FusedDecoderLayer)
    batch = prompts(8, seed=4, lo=3, hi=60)
    assert run(fast, batch) == run(slow, batch)
    again = [p + [5, 6, 7] for p in batch[:3]]  # prefix-cache hits: prefill with context
    assert run(fast, again) == run(slow, again)


def test_prefill_worker_layers_never_take_the_one_call_path(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 20)
    eng = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir, role="prefill")
    layer = eng.runner.model.layers[0]
    assert isinstance(layer, FusedDecoderLayer) and not layer.one_call  # no panel weights


def test_fp8_cache_keeps_the_reference_layer(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 20, kv_cache_dtype="fp8")
    eng = Engine(EngineConfig(model="tiny", cache=cache), model_dir=tiny_model_dir)
    assert not isinstance(eng.runner.model.layers[0], FusedDecoderLayer)
    assert run(eng, prompts(2, seed=1))  # and it runs
