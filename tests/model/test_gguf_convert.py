"""GGUF -> HF conversion on a tiny llama GGUF written by the test itself.

`write_tiny_gguf` is shared with the registry and tokenizer tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from pdserve.model import gguf_convert
from pdserve.model.gguf_convert import convert_gguf

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
Q8_0, Q4_1, F32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, None)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Byte-level BPE vocab: specials, all 256 byte symbols, then the merged tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = ["".join(merge.split(" ")) for merge in MERGES]
    tokens = SPECIAL_TOKENS + list(bytes_to_unicode().values()) + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to q/k rows (copied from llama.cpp)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_hf_weights(vocab_size: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in HF layout, keyed by HF name."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rand(HIDDEN)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(vocab_size, HIDDEN), "model.norm.weight": norm()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "post_attention_layernorm.weight"] = norm()
    if not tied:
        weights["lm_head.weight"] = rand(vocab_size, HIDDEN)
    return weights


# GGUF name and storage type per HF tensor name suffix: a mix of F32, Q8_0 and Q4_1.
_GGUF_LAYOUT = {
    "self_attn.q_proj": ("attn_q", Q4_1),
    "self_attn.k_proj": ("attn_k", Q8_0),
    "self_attn.v_proj": ("attn_v", F32),
    "self_attn.o_proj": ("attn_output", Q4_1),
    "mlp.gate_proj": ("ffn_gate", Q8_0),
    "mlp.up_proj": ("ffn_up", F32),
    "mlp.down_proj": ("ffn_down", Q4_1),
    "input_layernorm": ("attn_norm", F32),
    "post_attention_layernorm": ("ffn_norm", F32),
}
_GGUF_GLOBALS = {
    "model.embed_tokens.weight": ("token_embd.weight", Q8_0),
    "model.norm.weight": ("output_norm.weight", F32),
    "lm_head.weight": ("output.weight", F32),
}


def gguf_name_and_type(hf_name: str) -> tuple[str, gguf.GGMLQuantizationType | None]:
    if hf_name in _GGUF_GLOBALS:
        return _GGUF_GLOBALS[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    name, qtype = _GGUF_LAYOUT[".".join(module)]
    return f"blk.{layer}.{name}.weight", qtype


def expected_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What conversion must produce: each HF tensor after its GGUF quantization round trip."""
    expected = {}
    for hf_name, value in weights.items():
        _, qtype = gguf_name_and_type(hf_name)
        if qtype is None:
            expected[hf_name] = value
        else:
            expected[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
    return expected


def write_tiny_gguf(
    path: Path, *, tied: bool = True, arch: str = "llama"
) -> tuple[Path, dict[str, np.ndarray]]:
    """A 2-layer llama GGUF with a byte-level BPE tokenizer; returns (path, HF-layout weights).

    Q/K are stored permuted, as llama.cpp's converter writes them.
    """
    tokens, types = tiny_vocab()
    weights = tiny_hf_weights(len(tokens), tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, value in weights.items():
        name, qtype = gguf_name_and_type(hf_name)
        if ".attn_q." in name:
            value = llama_cpp_permute(value, HEADS)
        elif ".attn_k." in name:
            value = llama_cpp_permute(value, KV_HEADS)
        if qtype is None:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(gguf path, converted dir, HF weights) for an untied tiny model."""
    root = tmp_path_factory.mktemp("untied")
    gguf_path, weights = write_tiny_gguf(root / "tiny.gguf", tied=False)
    return gguf_path, convert_gguf(gguf_path, root / "hf"), weights


def test_tensors_equal_dequantized_source_with_qk_unpermuted(tmp_path: Path) -> None:
    gguf_path, weights = write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    out = convert_gguf(gguf_path, tmp_path / "hf")
    converted = load_file(str(out / "model.safetensors"))
    expected = expected_weights(weights)
    assert set(converted) == set(expected)  # tied: no lm_head.weight
    for name, value in expected.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], value, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 50000.0
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert (config["head_dim"], config["vocab_size"]) == (HEAD_DIM, len(tiny_vocab()[0]))
    assert (config["eos_token_id"], config["max_position_embeddings"]) == (2, 128)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no temp dirs left


def transformers_gguf_reference(gguf_path: Path) -> torch.nn.Module:
    """The model as transformers' own GGUF integration loads it (fp32).

    `from_pretrained(..., gguf_file=...)` needs `accelerate`, which this project does not install,
    so this runs the same steps by hand: GGUF config, then `load_gguf_checkpoint`, which
    dequantizes and reverse-permutes Q/K itself.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.float().eval()


def test_matches_transformers_gguf_loading(tiny_untied: tuple[Path, Path, dict]) -> None:
    from transformers import LlamaForCausalLM

    gguf_path, out, _ = tiny_untied
    ours = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = transformers_gguf_reference(gguf_path)
    ours_state, reference_state = ours.state_dict(), reference.state_dict()
    assert "lm_head.weight" in ours_state and not ours.config.tie_word_embeddings
    assert set(ours_state) == set(reference_state)
    for name, value in reference_state.items():
        assert torch.equal(ours_state[name], value), name
    input_ids = torch.tensor([[1, 40, 80, 120, 160, 200, 240, 261]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, reference(input_ids).logits)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a gguf file at all" * 10, "truncated"],
    ids=["empty", "not-gguf", "truncated"],
)
def test_bad_file_raises_value_error_naming_it(
    tmp_path: Path, tiny_untied: tuple[Path, Path, dict], content: bytes | str
) -> None:
    bad = tmp_path / "bad.gguf"
    if content == "truncated":
        data = tiny_untied[0].read_bytes()
        content = data[: len(data) // 2]
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    gguf_path, _ = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match="falcon.gguf.*unsupported architecture 'falcon'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_interrupted_conversion_keeps_previous_output(
    tmp_path: Path, tiny_untied: tuple[Path, Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tiny_untied[0]
    out = convert_gguf(gguf_path, tmp_path / "hf")
    before = sorted(p.name for p in out.iterdir())

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # the temp dir was removed
