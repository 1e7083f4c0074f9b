"""The fused decoder layer (native kernels) equals the PyTorch reference layer."""

from types import SimpleNamespace

import pytest
import torch

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model import quant_linear
from pdserve.model.cpu_fused import FusedDecoderLayer, fuse_layers
from pdserve.model.loader import load_model
from tests.engine.test_engine import make_engine, prompts, run
from tests.model.test_llama import our_logits

# Every test once per kernel variant (the `lib` fixture also makes engines load it).
pytestmark = pytest.mark.usefixtures("lib")


def test_fused_prefill_logits_equal_reference(tiny_model_dir, lib):
    ids = [3, 17, 99, 4, 56, 2, 81, 33, 7, 120, 64, 5, 9]
    model = load_model(tiny_model_dir)
    want = our_logits(model, ids)
    assert fuse_layers(model, lib) == 2
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.layers)
    torch.testing.assert_close(our_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def engine(model_dir, kernels: str, **sched) -> Engine:
    return make_engine(model_dir, device=DeviceConfig(cpu_kernels=kernels), **sched)


def test_native_engine_equals_torch_engine(tiny_model_dir):
    """Mixed steps (decodes next to prefill chunks), batches of 1 to 8 decodes, prefix hits."""
    fast = engine(
        tiny_model_dir, "native", max_num_batched_tokens=24, long_prefill_token_threshold=8
    )
    assert isinstance(fast.runner.model.layers[0], FusedDecoderLayer)
    assert fast.runner.model.layers.one_call  # decode-only steps: one native call
    slow = engine(tiny_model_dir, "torch")
    assert not isinstance(slow.runner.model.layers[0], FusedDecoderLayer)
    batch = prompts(8, seed=4, lo=3, hi=60)
    assert run(fast, batch) == run(slow, batch)
    again = [p + [5, 6, 7] for p in batch[:3]]  # prefix-cache hits: prefill with context
    assert run(fast, again) == run(slow, again)


def test_prefill_worker_layers_never_take_the_one_call_path(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 20)
    eng = Engine(EngineConfig(model="tiny", cache=cache), tiny_model_dir, kernels="prefill")
    layers = eng.runner.model.layers
    assert isinstance(layers[0], FusedDecoderLayer) and not layers.one_call  # no panel weights


def test_fp8_cache_keeps_the_reference_layer(tiny_model_dir):
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 20, kv_cache_dtype="fp8")
    eng = Engine(EngineConfig(model="tiny", cache=cache), model_dir=tiny_model_dir)
    assert not isinstance(eng.runner.model.layers[0], FusedDecoderLayer)
    assert run(eng, prompts(2, seed=1))  # and it runs


def test_one_call_stack_with_a_layer_hook_equals_without(tiny_model_dir):
    """With a hook between layers (layer-wise KV transfer) the stack calls C once a layer."""
    plain, hooked = engine(tiny_model_dir, "native"), engine(tiny_model_dir, "native")
    stack, seen = hooked.runner.model.layers, []
    forward = stack.forward

    def with_hook(x, cos, sin, caches, meta, on_layer_done=None):
        seen.clear()
        return forward(x, cos, sin, caches, meta, seen.append)

    real, counts = stack.lib, []  # layers per native call
    stack.lib = SimpleNamespace(
        pd_decode_layer_scratch=real.pd_decode_layer_scratch,
        pd_decode_layers=lambda *a: counts.append(a[4]) or real.pd_decode_layers(*a),
    )
    stack.forward = with_hook
    batch = prompts(4, seed=9, lo=3, hi=30)
    assert run(hooked, batch) == run(plain, batch)
    assert counts and set(counts) == {1}
    assert seen == list(range(len(stack)))


@pytest.fixture(scope="module")
def q4_k_m_dir(tmp_path_factory):
    """The tiny shape as a Q4_K_M GGUF, resolved to a directory whose model reads it in place."""
    from pdserve.model.registry import resolve_model
    from pdserve.model.synthetic import write_synthetic_gguf

    root = tmp_path_factory.mktemp("gguf")
    path = write_synthetic_gguf(root / "tiny.q4_k_m.gguf", "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(root / "cache"))
        return resolve_model(str(path))


@pytest.mark.parametrize("int8_m_max", [0, quant_linear.QUANT_GEMV_M_MAX])
def test_gguf_weights_in_place_take_the_one_call_and_equal_the_layers(
    q4_k_m_dir, int8_m_max, monkeypatch
):
    """Decode steps of GGUF weights read in place run all layers in one native call (pd_quant_linear
    inside pd_decode_layers) with the same tokens as a call per layer; batches past
    QUANT_GEMV_M_MAX rows take the layers one by one."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", int8_m_max)
    cache = CacheConfig(block_size=4, kv_cache_bytes=4 << 20)

    def gguf_engine() -> Engine:
        return Engine(EngineConfig(model="tiny", cache=cache), model_dir=q4_k_m_dir)

    fast, slow = gguf_engine(), gguf_engine()
    stack = fast.runner.model.layers
    assert stack.one_call and stack.max_rows == quant_linear.QUANT_GEMV_M_MAX
    slow.runner.model.layers.one_call = False
    real, rows = stack.lib, []  # rows of each one-call step
    stack.lib = SimpleNamespace(
        pd_decode_layer_scratch=real.pd_decode_layer_scratch,
        pd_decode_layers=lambda *a: rows.append(a[2]) or real.pd_decode_layers(*a),
    )
    for n in (1, 2, 5, 20):
        batch = prompts(n, seed=n, lo=3, hi=30)
        assert run(fast, batch) == run(slow, batch)
    assert {1, 2, 5} <= set(rows) and max(rows) <= quant_linear.QUANT_GEMV_M_MAX
