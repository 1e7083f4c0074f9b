"""Every model family pdserve runs, token for token against transformers' generate on a tiny
random-weight model of that family, and its GGUF (written here with llama.cpp's tensor names
and metadata keys) against the Hugging Face directory of the same weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model import native, quant_linear
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_fused import FusedDecoderLayer
from pdserve.model.gguf_convert import convert_gguf
from pdserve.model.gguf_weights import weights_source
from pdserve.model.loader import load_model
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX
from pdserve.model.rope import inv_frequencies
from pdserve.sampling_params import SamplingParams
from tests.model.test_gguf_convert import CHAT_TEMPLATE, MERGES, llama_cpp_permute, tiny_vocab
from tests.model.test_llama import our_logits

NUM_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 40, 80, 120, 160, 200, 240, 261, 7], [99, 3, 17]]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so the scaling bends most frequencies
}
# family -> (transformers config and model class names, overrides, llama.cpp architecture)
FAMILIES = {
    "llama2": ("Llama", {}, "llama"),
    "llama3-untied": ("Llama", {"rope_scaling": LLAMA3_ROPE}, "llama"),
    "llama3-tied": ("Llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}, "llama"),
    "mistral": ("Mistral", {"sliding_window": None}, "llama"),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("Qwen3", {"head_dim": 32}, "qwen3"),  # head_dim != hidden / heads, as in Qwen3
    "phi3": ("Phi3", {"pad_token_id": 0}, "phi3"),
}


def make_family(path: Path, family: str, **extra) -> Path:
    """A seeded random-weight model of `family` saved as an HF directory (fp32)."""
    import transformers

    prefix, overrides, _ = FAMILIES[family]
    cfg = dict(
        vocab_size=len(tiny_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
    )
    cfg.update(overrides, **extra)
    config = getattr(transformers, f"{prefix}Config")(**cfg)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float()
    # Larger matrices separate the logits (greedy ties would make the comparison moot);
    # random norms and biases, so a norm or bias loaded wrong or skipped changes the tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_generate(model_dir: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def generate(model_dir: Path, kernels: str = "torch") -> tuple[list[list[int]], Engine]:
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 22)
    engine = Engine(
        EngineConfig(model="tiny", cache=cache, device=DeviceConfig(cpu_kernels=kernels)),
        model_dir=model_dir,
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(PROMPTS))], engine


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_family(tmp_path_factory.mktemp(request.param), request.param)


def test_hf_directory_generates_what_transformers_generates(family):
    name, model_dir = family
    ids = PROMPTS[0]
    torch.testing.assert_close(
        our_logits(load_model(model_dir), ids), hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4
    )
    tokens, _ = generate(model_dir)
    assert tokens == [hf_generate(model_dir, p) for p in PROMPTS]


def test_native_kernels_generate_what_torch_generates(family):
    name, model_dir = family
    fast, engine = generate(model_dir, "native")
    layers = engine.runner.model.layers
    if not isinstance(layers[0], FusedDecoderLayer):
        pytest.skip("the native CPU kernels do not run on this machine")
    assert layers.one_call  # decode-only steps run all layers in one native call
    assert fast == generate(model_dir)[0]


def test_qwen3_one_call_decode_on_every_kernel_variant(lib, tmp_path):
    """The per-head Q/K norms inside the one-call decode kernel, per ISA variant (the
    `lib` fixture makes the engine load it): AVX2, AVX-512 and AMX builds alike."""
    model_dir = make_family(tmp_path, "qwen3")
    fast, engine = generate(model_dir, "native")
    assert engine.runner.kernels.isa == lib.isa and engine.runner.model.layers.one_call
    assert fast == [hf_generate(model_dir, p) for p in PROMPTS]


def test_gguf_generates_what_the_hf_directory_generates(family, tmp_path):
    name, model_dir = family
    gguf_path = write_family_gguf(model_dir, FAMILIES[name][2], tmp_path / f"{name}.gguf")
    converted = convert_gguf(gguf_path, tmp_path / "converted")
    assert ModelConfig.from_dir(converted).qk_norm == (name == "qwen3")
    ids = PROMPTS[0]
    torch.testing.assert_close(
        our_logits(load_model(converted), ids),
        our_logits(load_model(model_dir), ids),
        atol=1e-4,
        rtol=1e-4,
    )
    assert generate(converted)[0] == generate(model_dir)[0]


@pytest.mark.parametrize("name", ["llama3-untied", "qwen3", "phi3"])
def test_f16_gguf_generates_what_the_hf_directory_generates(name, tmp_path, monkeypatch):
    """F16 matrices are read in place (gguf_weights.py) in every family: Llama's permuted
    Q/K rows, Qwen3's Q/K norms, Phi-3's fused QKV and gate|up. The HF weights are rounded to
    fp16 first, so both hold the same values. On the fp32 path: the two prompts' 12-row
    prefill would take AMX tiles above AMX_FLOAT_GEMV_M_MAX rows, whose bf16 rounding flips
    Qwen3's 9th token of the second prompt (tests/model/test_safetensors_weights.py bounds
    the tiles' logits)."""
    model_dir = make_family(tmp_path / "hf", name)
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v.half().float() for k, v in weights.items()}, model_dir / "model.safetensors")
    arch = FAMILIES[name][2]
    gguf_path = write_family_gguf(model_dir, arch, tmp_path / f"{name}.gguf", f16=True)
    converted = convert_gguf(gguf_path, tmp_path / "converted")
    assert weights_source(converted) == gguf_path.resolve()
    if native.load() is None:
        pytest.skip("GGUF weights read in place need the native CPU kernels")
    monkeypatch.setattr(quant_linear, "AMX_FLOAT_GEMV_M_MAX", QUANT_GEMV_M_MAX)
    assert generate(converted)[0] == generate(model_dir)[0]


def llama3_rope_freqs(hf: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for a Llama 3.1 config (convert_hf_to_gguf.py's loop)."""
    s, dim = hf["rope_scaling"], hf["hidden_size"] // hf["num_attention_heads"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    freqs = 1.0 / (hf["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# HF name (after `model.layers.N.`) -> llama.cpp's tensor name (after `blk.N.`)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",  # Qwen3
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_family_gguf(model_dir: Path, arch: str, path: Path, f16: bool = False) -> Path:
    """The HF directory's weights as llama.cpp's converter writes them (F32, or matrices in
    F16), with a tiny byte-level BPE tokenizer whose vocabulary the model's embedding covers."""
    hf = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":
        freqs = llama3_rope_freqs(hf | {"rope_scaling": scaling, "rope_theta": theta})
        writer.add_tensor("rope_freqs.weight", freqs)
    for name, value in load_file(model_dir / "model.safetensors").items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        array = value.numpy().astype(np.float16 if f16 and value.dim() > 1 else np.float32)
        if name in _GLOBAL_NAMES:
            writer.add_tensor(_GLOBAL_NAMES[name], array)
            continue
        _, _, layer, *module, kind = name.split(".")
        gguf_name = f"blk.{layer}.{_LAYER_NAMES['.'.join(module)]}.{kind}"
        if arch == "llama" and kind == "weight" and module[-1] in ("q_proj", "k_proj"):
            array = llama_cpp_permute(array, heads if module[-1] == "q_proj" else kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_cpp_rope_freqs_are_the_llama3_scaling():
    hf = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 10000.0}
    factors = llama3_rope_freqs(hf | {"rope_scaling": LLAMA3_ROPE})
    from_gguf = inv_frequencies(16, 10000.0, {"rope_type": "freq_factors", "freq_factors": factors})
    llama3 = inv_frequencies(16, 10000.0, LLAMA3_ROPE)
    torch.testing.assert_close(from_gguf, llama3, atol=0, rtol=1e-6)
    assert not torch.allclose(llama3, inv_frequencies(16, 10000.0, None))  # the test bites


def test_sliding_window_shorter_than_the_context_caps_it(tmp_path):
    model_dir = make_family(tmp_path, "mistral", sliding_window=64)
    assert ModelConfig.from_dir(model_dir).max_position_embeddings == 64
    qwen = json.loads(
        (make_family(tmp_path / "q", "qwen2", sliding_window=64) / "config.json").read_text()
    )
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 256  # use_sliding_window off


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "'GemmaForCausalLM'.*Qwen3ForCausalLM"),
        (
            {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope"}},
            "Phi3ForCausalLM: rope scaling 'longrope' is unsupported",
        ),
        (
            {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75},
            "partial rotary",
        ),
    ],
    ids=["unknown-family", "phi3-longrope", "partial-rotary"],
)
def test_unsupported_models_are_refused_by_name(hf, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)
