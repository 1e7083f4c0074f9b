"""A bf16/fp16 Hugging Face checkpoint is read in place (safetensors_weights.py): its logits and
greedy tokens equal transformers' run in fp32 on the same values, its mapped pages are shared
between processes, and loading it holds no fp32 copy."""

import json
import logging
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model import native, quant_linear
from pdserve.model.loader import load_model
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantLinear, QuantTensor
from pdserve.model.safetensors_header import in_place_bytes, map_checkpoint
from pdserve.workers.memory_report import MemoryReport
from tests.model.test_families import (
    FAMILIES,
    PROMPTS,
    generate,
    hf_generate,
    hf_logits,
    make_family,
)
from tests.model.test_gguf_weights import mapping, two_processes
from tests.model.test_llama import assert_logits_on_each_path, our_logits

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs the native CPU kernels")
BF16, F16, F32 = 30, 1, 0


def save_as(fp32_dir, out_dir, dtype: torch.dtype, **save_kwargs):
    """transformers' save_pretrained of the fp32 model `fp32_dir` cast to `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    return out_dir


def weight_types(model) -> set[int]:
    return {p.qtype for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "llama2"])
def bf16_family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    fp32_dir = make_family(root / "fp32", request.param)
    return request.param, save_as(fp32_dir, root / "bf16", torch.bfloat16)


def test_bf16_checkpoint_is_read_in_place_as_transformers_runs_it(bf16_family, monkeypatch):
    """transformers widens the same bf16 values to fp32; the kernels do too, so the logits
    differ only by summation order and every greedy token is the same. A prompt above
    AMX_FLOAT_GEMV_M_MAX rows takes AMX tiles on the amx kernels, whose bf16 activations move
    the logits by about 2^-8 of their norm (measured 0.3-0.5% over the families); without the
    tiles it keeps the widened fp32 path. The served tokens are compared on the fp32 path
    (tiles above QUANT_GEMV_M_MAX rows, as before): the two prompts' 12-row prefill would
    take the tiles, whose rounding may flip a token of a random model where its top two
    nearly tie."""
    name, model_dir = bf16_family
    assert {e.dtype for e in map_checkpoint(model_dir).values()} == {"BF16"}
    model = load_model(model_dir)
    assert weight_types(model) == {BF16}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert_logits_on_each_path(model, PROMPTS[0], hf_logits(model_dir, PROMPTS[0]))
    long_prompt = [(i * 37) % 250 + 3 for i in range(QUANT_GEMV_M_MAX + 7)]
    theirs = hf_logits(model_dir, long_prompt)
    tiles, on_tiles = our_logits(model, long_prompt), model.lm_head.amx_tiles
    if on_tiles:
        assert (tiles - theirs).norm() <= 2**-6 * theirs.norm()
    monkeypatch.setattr(quant_linear, "AMX_TILES", False)
    widened = our_logits(model, long_prompt)
    torch.testing.assert_close(widened, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(widened.argmax(-1), theirs.argmax(-1))
    assert on_tiles or torch.equal(tiles, widened)
    monkeypatch.setattr(quant_linear, "AMX_FLOAT_GEMV_M_MAX", QUANT_GEMV_M_MAX)
    expected = [hf_generate(model_dir, p) for p in PROMPTS]
    tokens, engine = generate(model_dir, "native")
    assert engine.runner.model.layers.one_call  # the one-call decode step on mapped weights
    assert tokens == expected
    assert generate(model_dir, "torch")[0] == expected


def test_qwen2_biases_on_every_kernel_variant(lib, tmp_path):
    """Q/K/V biases beside mapped bf16 weights in the one-call decode step, per ISA build."""
    model_dir = save_as(make_family(tmp_path / "fp32", "qwen2"), tmp_path / "bf16", torch.bfloat16)
    tokens, engine = generate(model_dir, "native")
    assert engine.runner.kernels.isa == lib.isa and engine.runner.model.layers.one_call
    assert tokens == [hf_generate(model_dir, p) for p in PROMPTS]


def as_part(w: torch.Tensor, name: str = "w") -> QuantTensor:
    """A bf16/fp16 [N, K] tensor as a mapped checkpoint's matrix: its bytes, [N, 2K] uint8."""
    qtype = BF16 if w.dtype == torch.bfloat16 else F16
    data = w.view(torch.int16).numpy().view(np.uint8).reshape(w.shape[0], -1)
    return QuantTensor(data, qtype, *w.shape, name)


def amx_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """max |y - x w^T| per output on AMX tiles: x rounded to bf16 (at most 2^-8 of the value:
    bf16 keeps 8 significant bits), a bf16 weight as it is, an fp16 one rounded as x; exact
    products; fp32 sums (at most K 2^-24 of sum |x w|)."""
    roundings = 1 if w.dtype == torch.bfloat16 else 2
    product = x.abs().double() @ w.abs().double().T
    return product * ((1 + 2.0**-8) ** roundings - 1 + x.shape[1] * 2.0**-24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m, n, k", [(QUANT_GEMV_M_MAX + 1, 37, 768), (33, 50, 100), (70, 129, 7)])
def test_many_rows_on_amx_tiles_within_the_bf16_bound(lib, dtype, m, n, k):
    """Above QUANT_GEMV_M_MAX rows, on the amx kernels, bf16/fp16 matrices take AMX bf16 tiles
    (csrc/quant_amx.c), within `amx_bound` of torch's matmul of the same weights widened; odd
    K and N (the tiles are zero past them). The other kernel variants keep the fp32 path."""
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = 3 * torch.randn(m, k, generator=gen)
    linear = QuantLinear(lib, [as_part(w)])
    y, reference = linear(x), x @ w.float().T
    if not hasattr(lib, "pd_quant_linear_amx"):
        assert not linear.amx_tiles
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-4)
        return
    assert linear.amx_tiles
    err = (y.double() - (x.double() @ w.double().T)).abs()
    assert torch.all(err <= amx_bound(x, w))
    assert (y - reference).abs().max() > 0  # x did round to bf16


def test_fused_bf16_and_f16_parts_on_amx_tiles(lib):
    """A fused linear of a bf16 and an fp16 part with a bias (Q/K/V of a Qwen2) on AMX tiles:
    each part's columns within its own bound."""
    if not hasattr(lib, "pd_quant_linear_amx"):
        pytest.skip(f"the {lib.isa} kernels have no AMX tiles")
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(40, 96, generator=gen).bfloat16()
    b = torch.randn(9, 96, generator=gen).half()
    bias, x = torch.randn(49, generator=gen), torch.randn(45, 96, generator=gen)
    linear = QuantLinear(lib, [as_part(a, "a"), as_part(b, "b")], bias)
    assert linear.amx_tiles
    y = (linear(x) - bias).double()
    for w, cols in ((a, slice(0, 40)), (b, slice(40, 49))):
        assert torch.all((y[:, cols] - x.double() @ w.double().T).abs() <= amx_bound(x, w))


def test_f16_and_sharded_checkpoints(tmp_path):
    fp32_dir = make_family(tmp_path / "fp32", "llama3-untied")
    f16_dir = save_as(fp32_dir, tmp_path / "f16", torch.float16)
    sharded = save_as(fp32_dir, tmp_path / "sharded", torch.float16, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = PROMPTS[0]
    whole, shards = load_model(f16_dir), load_model(sharded)
    assert weight_types(whole) == weight_types(shards) == {F16}
    assert_logits_on_each_path(whole, ids, hf_logits(f16_dir, ids))
    assert torch.equal(our_logits(shards, ids), our_logits(whole, ids))


def test_fp32_checkpoint_loads_as_fp32_tensors(tiny_model_dir):
    """The rule: fp32 checkpoints keep the fp32 path (nn.Linear, panels, oneDNN)."""
    model = load_model(tiny_model_dir)
    assert not weight_types(model) and isinstance(model.lm_head, torch.nn.Linear)
    assert in_place_bytes(tiny_model_dir) == 0


def test_bf16_runs_in_another_dtype_load_as_before(bf16_family):
    name, model_dir = bf16_family
    model = load_model(model_dir, dtype="bfloat16")
    assert not weight_types(model) and model.lm_head.weight.dtype == torch.bfloat16


def rewrite(model_dir, change):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_and_unused_tensors_are_named(bf16_family, tmp_path):
    name, model_dir = bf16_family
    missing = save_as(model_dir, tmp_path / "missing", torch.bfloat16)
    rewrite(missing, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks the tensor 'model\.layers\.1\.mlp\.down_proj"):
        load_model(missing)
    extra = save_as(model_dir, tmp_path / "extra", torch.bfloat16)
    rewrite(
        extra, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2, 2).bfloat16()})
    )
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.9\.extra\.weight'\]"):
        load_model(extra)


def test_a_matrix_the_kernels_cannot_read_is_widened_and_counted(tmp_path, caplog):
    """An F64 matrix in a bf16 checkpoint (safetensors_header.WIDENED_TYPES) becomes an fp32
    copy of the worker's own while the rest stays mapped: logged at load naming it and why,
    counted in the worker's Stats (`weights_widened`)."""
    fp32_dir = make_family(tmp_path / "fp32", "llama3-untied")
    model_dir = save_as(fp32_dir, tmp_path / "bf16", torch.bfloat16)
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite(model_dir, lambda t: t.update({name: t[name].double()}))
    with caplog.at_level(logging.WARNING, logger="pdserve.model.safetensors_weights"):
        model = load_model(model_dir)
    assert model.widened_weights == {name: "dtype_F64"}
    assert "1 matrices widened to fp32" in caplog.text and f"{name} (dtype_F64)" in caplog.text
    assert weight_types(model) == {BF16, F32}
    assert model.layers[1].mlp.down_proj.parts[0].qtype == F32
    assert MemoryReport(model, torch.zeros(1)).fields()["weights_widened"] == {"dtype_F64": 1}
    assert_logits_on_each_path(model, PROMPTS[0], hf_logits(model_dir, PROMPTS[0]))


def test_without_native_kernels_every_matrix_is_widened_and_counted(bf16_family, monkeypatch):
    """Where the native kernels cannot run, loader.py converts the whole bf16 checkpoint to
    fp32: every matrix counted as widened (no_native_kernels)."""
    name, model_dir = bf16_family
    monkeypatch.setattr(native, "load", lambda *args: None)
    model = load_model(model_dir)
    matrices = [k for k, e in map_checkpoint(model_dir).items() if len(e.shape) == 2]
    assert model.widened_weights == dict.fromkeys(matrices, "no_native_kernels")
    widened = MemoryReport(model, torch.zeros(1)).fields()["weights_widened"]
    assert widened == {"no_native_kernels": len(matrices)}
    assert not weight_types(model)


# Loads the model, runs every matrix once, prints its peak RSS growth over the loading
# (kB, VmHWM - VmRSS before) and waits for a line on stdin.
LOADER = """
import sys, torch
from tests.model.test_llama import our_logits
from pdserve.model.loader import load_model
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
before = status("VmRSS")
model = load_model(sys.argv[1])
our_logits(model, list(range(1, 9)))
print(status("VmHWM") - before, flush=True)
sys.stdin.readline()
"""


def big_checkpoint(model_dir, layers: int) -> int:
    """A random bf16 Llama of ~32 MiB a layer, written without transformers; its file size."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (512, 1024),
        "lm_head.weight": (512, 1024),
        "model.norm.weight": (1024,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for x in "qkvo":
            shapes[p + f"self_attn.{x}_proj.weight"] = (1024, 1024)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (4096, 1024)
        shapes[p + "mlp.down_proj.weight"] = (1024, 4096)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (
            1024,
        )
    tensors = {k: (0.02 * torch.randn(s, generator=gen)).bfloat16() for k, s in shapes.items()}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return (model_dir / "model.safetensors").stat().st_size


@pytest.mark.slow  # writes a 200 MB checkpoint; two processes load it
def test_loading_holds_no_fp32_copy_and_two_processes_share_the_pages(tmp_path):
    """Peak RSS of loading a ~200 MB bf16 checkpoint (and running it) grows by about the
    file's size, whose pages two processes share."""
    model_dir = tmp_path / "big"
    size_kb = big_checkpoint(model_dir, layers=6) // 1024
    procs = two_processes(LOADER, model_dir)
    try:
        growth_kb = [int(p.stdout.readline()) for p in procs]
        time.sleep(0.1)
        usage = [mapping(p.pid, (model_dir / "model.safetensors").resolve()) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    for growth, u in zip(growth_kb, usage):
        # The mapped file, plus torch's first use of the meta device (~75 MB of operator
        # registrations, in every loading path) and the activations: an fp32 copy would add
        # twice the file.
        assert growth < size_kb + 128 * 1024
        assert u["Rss"] > 0.95 * size_kb  # each maps the whole file...
        assert u["Pss"] < 0.6 * u["Rss"]  # ...and owns about half of it: the pages are shared
