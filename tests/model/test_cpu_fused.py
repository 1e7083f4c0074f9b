"""The fused decoder layer (native kernels) equals the PyTorch reference layer."""

from types import SimpleNamespace

import pytest
import torch

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model import quant_linear
from pdserve.model.cpu_fused import FusedDecoderLayer, FusedLayerStack, _linears, fuse_layers
from pdserve.model.llama import LayerStack
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


@pytest.fixture(scope="module", params=["q4_k_m", "q8_0", "qwen2-bf16"])
def in_place_dir(request, tmp_path_factory):
    """A model directory whose matrices are read in place: the tiny shape as a GGUF (Q4_K_M:
    Q4_K and Q6_K matrices; Q8_0, no fp32 copy allowed), or a bf16 Qwen2 checkpoint (Q/K/V
    biases); and whether every matrix has int8 dot products."""
    from pdserve.model.registry import resolve_model
    from pdserve.model.synthetic import write_synthetic_gguf
    from tests.model.test_families import make_family
    from tests.model.test_safetensors_weights import save_as

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2-bf16":
        return save_as(make_family(root / "fp32", "qwen2"), root / "bf16", torch.bfloat16), False
    path = write_synthetic_gguf(root / f"tiny.{request.param}.gguf", "tiny", request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(root / "cache"))
        return resolve_model(str(path), gguf_fp32_max_bytes=0), True


def check_each_decode_step(stack: FusedLayerStack) -> list[int]:
    """Has every decode-only step of `stack` run layer by layer too (on a copy of its input,
    before the step itself rewrites the same cache slots) and the outputs compared; returns
    the rows of each step that took the one native call."""
    forward, real, rows = stack.forward, stack.lib, []

    def both(x, cos, sin, caches, meta, on_layer_done=None):
        if meta.prefills:
            return forward(x, cos, sin, caches, meta, on_layer_done)
        want = LayerStack.forward(stack, x.clone(), cos, sin, caches, meta)
        got = forward(x, cos, sin, caches, meta, on_layer_done)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return got

    stack.forward = both
    stack.lib = SimpleNamespace(
        pd_decode_layer_scratch=real.pd_decode_layer_scratch,
        pd_decode_layers=lambda *a: rows.append(a[2]) or real.pd_decode_layers(*a),
    )
    return rows


@pytest.mark.parametrize("int8_m_max", [0, quant_linear.QUANT_GEMV_M_MAX])
def test_weights_in_place_take_the_one_call_and_equal_the_layers(
    in_place_dir, int8_m_max, monkeypatch
):
    """Decode steps of weights read in place (QuantLinear) run all layers in one native call, each
    linear on the kernel QuantLinear.forward takes for that many rows (fp32 or int8 row-wise
    up to QUANT_GEMV_M_MAX; above it int8 activations, or AMX tiles on the amx kernels, up to
    INT8_MANY_M_MAX), and equal the layers called one by one; batches where a linear would
    take PyTorch's GEMM take the layers one by one."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", int8_m_max)
    cache = CacheConfig(block_size=4, kv_cache_bytes=8 << 20)
    model_dir, int8_types = in_place_dir
    eng = Engine(EngineConfig(model="tiny", cache=cache), model_dir=model_dir)
    stack = eng.runner.model.layers
    linears = [m for layer in stack for m in _linears(layer)]
    many = all(m.amx_tiles or m.int8_many_rows for m in linears)
    assert many == (stack.lib.isa == "amx" or (int8_types and int8_m_max > 0))
    max_rows = quant_linear.INT8_MANY_M_MAX if many else quant_linear.QUANT_GEMV_M_MAX
    assert stack.one_call and stack.max_rows == max_rows
    rows = check_each_decode_step(stack)
    for n in (1, 5, 17, 32, 64):
        assert run(eng, prompts(n, seed=n, lo=3, hi=30))
    assert {1, 5} <= set(rows) and max(rows) <= max_rows
    assert {17, 32, 64} <= set(rows) if many else max(rows) <= quant_linear.QUANT_GEMV_M_MAX
