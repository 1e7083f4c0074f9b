"""Synthetic GGUFs: llama.cpp's tensors, types and metadata; finite logits; the tokenizer."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from pdserve.model import panel_codec
from pdserve.model.gguf_convert import convert_gguf
from pdserve.model.loader import load_model
from pdserve.model.registry import known_gguf_path
from pdserve.model.synthetic import (
    FILE_TYPES,
    SHAPES,
    WEIGHT_STD,
    Q,
    file_bytes,
    random_matrix,
    tensor_type,
    write_synthetic_gguf,
)
from pdserve.model.tokenizer import Tokenizer, load_tokenizer
from tests.model.test_llama import our_logits


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("synth") / "tiny.gguf", "tiny", "q4_k_m")


def test_tiny_round_trips_through_the_reader(tiny_gguf):
    reader = GGUFReader(tiny_gguf)
    shape = SHAPES["tiny"]
    meta = {k: f.contents() for k, f in reader.fields.items() if len(f.data) <= 1}
    assert meta["general.architecture"] == "llama"
    assert meta["llama.embedding_length"] == shape.hidden_size
    assert meta["llama.block_count"] == shape.num_layers
    assert meta["llama.attention.head_count_kv"] == shape.num_kv_heads
    assert meta["llama.feed_forward_length"] == shape.intermediate_size
    assert meta["general.file_type"] == int(FILE_TYPES["q4_k_m"][0])
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied
    # llama.cpp's Q4_K_M: the tied embedding and the "more bits" layer's attn_v/ffn_down Q6_K.
    assert tensors["token_embd.weight"].tensor_type == Q.Q6_K
    assert tensors["blk.0.attn_v.weight"].tensor_type == Q.Q4_K
    assert tensors["blk.1.attn_v.weight"].tensor_type == Q.Q6_K
    assert tensors["blk.1.ffn_down.weight"].tensor_type == Q.Q6_K
    assert tensors["blk.0.ffn_gate.weight"].tensor_type == Q.Q4_K
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    # GGUF lists dims innermost first: (row length, rows).
    assert list(tensors["blk.0.attn_k.weight"].shape) == [256, 2 * 64]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [512, 256]
    assert list(tensors["token_embd.weight"].shape) == [256, 49152]
    data_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert data_bytes == file_bytes(shape, "q4_k_m")
    default = GGUFReader(known_gguf_path("smollm2-135m"))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == default.fields[key].contents()
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152


@pytest.mark.parametrize(
    "qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16]
)
def test_random_matrices_are_centred_and_scaled(qtype):
    data = random_matrix((64, 512), qtype, np.random.default_rng(0))
    values = dequantize(data.reshape(64, -1), qtype)
    assert values.shape == (64, 512) and np.isfinite(values).all()
    assert abs(values.std() - WEIGHT_STD) < 0.1 * WEIGHT_STD
    assert abs(values.mean()) < 0.15 * WEIGHT_STD


def test_types_follow_llama_cpp():
    assert tensor_type("output.weight", 4096, "q4_1", 0, 32) == Q.Q6_K
    assert tensor_type("output.weight", 4096, "q8_0", 0, 32) == Q.Q8_0
    # A row that is not a whole number of K-quant blocks falls back as llama.cpp does.
    assert tensor_type("token_embd.weight@tied", 576, "q4_1", 0, 30) == Q.Q8_0
    assert tensor_type("blk.3.ffn_up.weight", 576, "q4_k_m", 3, 30) == Q.Q5_0
    # Q4_K_M: Q6_K in the first and last eighth and every third layer between.
    more = [
        i
        for i in range(16)
        if tensor_type(f"blk.{i}.ffn_down.weight", 8192, "q4_k_m", i, 16) == Q.Q6_K
    ]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]


def test_sizes_of_real_shapes():
    # The 3B Q4_1 file is 1.9 GB.
    assert 1.85e9 < file_bytes(SHAPES["llama-3b"], "q4_1") < 1.95e9
    with pytest.raises(ValueError, match="unknown type 'q3_k'"):
        file_bytes(SHAPES["tiny"], "q3_k")


def test_deep_model_gives_finite_logits_and_the_default_tokenizer(tmp_path):
    """Sixteen layers of the scaled random weights keep the activations finite; the file
    converts and loads like any GGUF, with the default model's tokenizer."""
    shape = replace(SHAPES["tiny"], num_layers=16)
    path = write_synthetic_gguf(tmp_path / "deep.gguf", shape, "q4_k_m")
    model_dir = convert_gguf(path, tmp_path / "deep")
    model = load_model(model_dir)
    assert model.config.num_layers == 16 and model.config.vocab_size == 49152
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert ids == load_tokenizer("smollm2-135m").encode(
        "The quick brown fox jumps over the lazy dog."
    )
    with torch.no_grad():
        logits = our_logits(model, ids)
    assert logits.shape == (len(ids), 49152)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not collapsed to zero either


def test_qwen3_shape_converts_with_its_q_k_norms(tmp_path):
    """A Qwen3-shaped file (head_dim apart from hidden / heads, per-head Q/K norms) converts
    and runs like Qwen3's own GGUFs."""
    shape = replace(
        SHAPES["qwen3-0.6b"],
        hidden_size=256,
        num_layers=2,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        key_length=128,
    )
    path = write_synthetic_gguf(tmp_path / "qwen3.gguf", shape, "q8_0")
    model = load_model(convert_gguf(path, tmp_path / "qwen3"))
    assert model.config.qk_norm and model.config.head_dim == 128
    assert model.layers[0].self_attn.q_norm.weight.shape == (128,)
    with torch.no_grad():
        logits = our_logits(model, [5, 17, 300, 4000])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_cli_writes_a_file(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "tiny.q8_0.gguf"
    assert main(["synth", "--shape", "tiny", "--type", "q8_0", "--output", str(out)]) == 0
    assert out.stat().st_size > file_bytes(SHAPES["tiny"], "q8_0")  # plus the metadata
    assert "tiny q8_0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "qtype, codec",
    [(Q.Q4_1, panel_codec.Q4A), (Q.Q4_0, panel_codec.Q8S), (Q.Q8_0, panel_codec.Q8S)],
)
def test_legacy_quants_stay_compact_like_real_ones(qtype, codec):
    """The loader keeps GGUF-born Q4/Q8 weights compact, recognizing the block extremes
    llama.cpp's quantizer writes; synthetic blocks carry them, so memory is measured true."""
    data = random_matrix((96, 512), qtype, np.random.default_rng(0))
    weight = torch.from_numpy(dequantize(data.reshape(96, -1), qtype).astype(np.float32))
    assert panel_codec.encode(weight, 48)[0] == codec
