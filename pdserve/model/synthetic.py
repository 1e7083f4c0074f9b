"""Random-weight GGUF checkpoints of real model shapes, for tests and benchmarks.

Speed and memory depend on a model's shape and tensor types, not on its values, so a file with
the exact tensors of Llama 3.2 1B (say) in Q4_K_M measures what serving that model costs without
downloading it. `write_synthetic_gguf()` writes one: the named shape's tensors with the types
llama.cpp's quantizer picks for the chosen file type (`tensor_type()`), the default model's
tokenizer (SmolLM2's, copied key by key from the GGUF its pip package ships, so any prompt
tokenizes and the vocabulary is 49,152 whatever the shape), and llama.cpp's metadata keys.

Quantized tensors are random block bytes with the block scales (fp16) overwritten, so no
quantizer runs: every block is valid, and the scales are chosen so the dequantized weights have
mean ~0 and standard deviation `WEIGHT_STD` (the usual initializer's), which keeps activations
finite through every layer. Tensors are generated and written one at a time, so writing an 8B
file holds one tensor in memory, never the model.

Llama 3's rope scaling lives in a `rope_freqs.weight` tensor in llama.cpp's files; it is written
on request (`rope_freqs=True`); without it, the file's rope is plain rope at the shape's theta.

    pdserve synth --shape llama-1b --type q4_k_m --output llama-1b.q4_k_m.gguf
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

Q = GGMLQuantizationType
WEIGHT_STD = 0.02  # the dequantized weights' standard deviation (HF's initializer_range)
NORM_STD = 0.1  # the norm weights' spread around 1
DEFAULT_TOKENIZER_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Shape:
    """A model's shape, as its config.json has it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool
    # llama.cpp's name; "qwen2" has Q/K/V biases, "qwen3" Q/K norms, "phi3" fused matrices
    # (attn_qkv, and ffn_up holding gate and up)
    architecture: str = "llama"
    rms_norm_eps: float = 1e-5
    llama3_rope_factor: float | None = None  # Llama 3.1+ rope scaling (rope_freqs.weight)
    key_length: int | None = None  # head_dim where it is not hidden_size / num_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden_size // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"


SHAPES: dict[str, Shape] = {
    # Llama 3.2 1B / 3B, Llama 3.1 8B, Qwen2.5 1.5B: their Hugging Face config.json.
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 500000.0, 131072, True, llama3_rope_factor=32.0),
    "llama-3b": Shape(3072, 28, 24, 8, 8192, 500000.0, 131072, True, llama3_rope_factor=32.0),
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 500000.0, 131072, False, llama3_rope_factor=8.0),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 1e6, 32768, True, "qwen2", 1e-6),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, 1e6, 40960, True, "qwen3", 1e-6, key_length=128),
    "phi3-mini": Shape(3072, 32, 32, 32, 8192, 10000.0, 4096, False, "phi3"),
    # For tests: K-quant rows (256 values) fit every matrix; two layers, GQA, seconds to write.
    "tiny": Shape(256, 2, 4, 2, 512, 10000.0, 2048, True),
}

# File type -> (llama.cpp's file type, the type of most matrices).
FILE_TYPES: dict[str, tuple[LlamaFileType, Q]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
    "q5_1": (LlamaFileType.MOSTLY_Q5_1, Q.Q5_1),
    "q4_k": (LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K),
    "q5_k": (LlamaFileType.MOSTLY_Q5_K_S, Q.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
}
# llama.cpp's fallback when a row's length is not a multiple of the type's block (its
# llama_tensor_get_type): a K-quant falls back to a legacy type of about the same size.
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, row length)
    qtype: Q


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K in a *_K_M file: the first and last
    eighth and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, row_len: int, file_type: str, layer: int, num_layers: int) -> Q:
    """The type llama.cpp's quantizer gives a matrix of a `file_type` file (1-D tensors are
    always F32). The output matrix (the embedding when tied) is Q6_K in every quantized file
    below Q8_0; in *_K_M files, attn_v and ffn_down of half the layers are Q6_K too."""
    base = FILE_TYPES[file_type][1]
    qtype = base
    is_output = name == "output.weight" or name == "token_embd.weight@tied"
    if is_output and base not in FLOAT_TYPES + (Q.Q8_0,):
        qtype = Q.Q6_K
    elif file_type.endswith("_k_m") and name.rsplit(".", 2)[-2] in ("attn_v", "ffn_down"):
        qtype = Q.Q6_K if _use_more_bits(layer, num_layers) else base
    block = GGML_QUANT_SIZES[qtype][0]
    if row_len % block:
        qtype = FALLBACK.get(qtype, Q.F16)
        if row_len % GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16
    return qtype


def tensor_specs(shape: Shape, file_type: str, rope_freqs: bool = False) -> list[TensorSpec]:
    """Every tensor of `shape` in llama.cpp's names and order, with its type."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    s, vocab = shape, default_vocab_size()
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> TensorSpec:
        key = name + ("@tied" if name == "token_embd.weight" and s.tie_word_embeddings else "")
        return TensorSpec(
            name, (rows, cols), tensor_type(key, cols, file_type, layer, s.num_layers)
        )

    def vector(name: str, size: int) -> TensorSpec:
        return TensorSpec(name, (size,), Q.F32)

    specs = [matrix("token_embd.weight", vocab, s.hidden_size)]
    if rope_freqs and s.llama3_rope_factor is not None:
        specs.append(vector("rope_freqs.weight", s.head_dim // 2))
    for i in range(s.num_layers):
        b = f"blk.{i}."
        specs.append(vector(b + "attn_norm.weight", s.hidden_size))
        if s.architecture == "phi3":  # [q; k; v] rows in one matrix
            specs.append(matrix(b + "attn_qkv.weight", q_size + 2 * kv_size, s.hidden_size, i))
        for part, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            if s.architecture != "phi3":
                specs.append(matrix(f"{b}attn_{part}.weight", rows, s.hidden_size, i))
            if s.qkv_bias:
                specs.append(vector(f"{b}attn_{part}.bias", rows))
        specs.append(matrix(b + "attn_output.weight", s.hidden_size, q_size, i))
        if s.architecture == "qwen3":
            specs.append(vector(b + "attn_q_norm.weight", s.head_dim))
            specs.append(vector(b + "attn_k_norm.weight", s.head_dim))
        specs.append(vector(b + "ffn_norm.weight", s.hidden_size))
        specs += _ffn_specs(s, b, i, matrix)
    specs.append(vector("output_norm.weight", s.hidden_size))
    if not s.tie_word_embeddings:
        specs.append(matrix("output.weight", vocab, s.hidden_size))
    return specs


def _ffn_specs(s: Shape, b: str, i: int, matrix: Any) -> list[TensorSpec]:
    """A layer's gate, up and down matrices: Phi-3's ffn_up holds [gate; up] rows."""
    ffn, h = s.intermediate_size, s.hidden_size
    if s.architecture == "phi3":
        gate_up = [matrix(b + "ffn_up.weight", 2 * ffn, h, i)]
    else:
        gate_up = [matrix(b + "ffn_gate.weight", ffn, h, i), matrix(b + "ffn_up.weight", ffn, h, i)]
    return [*gate_up, matrix(b + "ffn_down.weight", h, ffn, i)]


def file_bytes(shape: Shape, file_type: str) -> int:
    """The tensor bytes of a file of `shape` and `file_type` (metadata excluded)."""
    return sum(_nbytes(spec) for spec in tensor_specs(shape, file_type))


def write_synthetic_gguf(
    path: Path,
    shape: Shape | str,
    file_type: str = "q4_k_m",
    seed: int = 0,
    rope_freqs: bool = False,
) -> Path:
    """Write a random-weight GGUF of `shape` (a `Shape` or a name in SHAPES) to `path`."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        name, shape = shape, SHAPES[shape]
    else:
        name = "custom"
    specs = tensor_specs(shape, file_type, rope_freqs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, shape.architecture)
    _add_metadata(writer, shape, file_type, f"pdserve synthetic {name}")
    for spec in specs:
        writer.add_tensor_info(
            spec.name, _byte_shape(spec), np.dtype(np.uint8), _nbytes(spec), spec.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for data in _tensor_data(specs, shape, rng):
        writer.write_tensor_data(data)
    writer.close()
    return path


def _add_metadata(writer: GGUFWriter, s: Shape, file_type: str, name: str) -> None:
    arch = s.architecture
    writer.add_name(name)
    writer.add_uint32(f"{arch}.block_count", s.num_layers)
    writer.add_uint32(f"{arch}.context_length", s.context_length)
    writer.add_uint32(f"{arch}.embedding_length", s.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", s.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", s.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", s.num_kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", s.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", default_vocab_size())
    writer.add_uint32(f"{arch}.rope.dimension_count", s.head_dim)
    if s.key_length is not None:
        writer.add_uint32(f"{arch}.attention.key_length", s.key_length)
        writer.add_uint32(f"{arch}.attention.value_length", s.key_length)
    writer.add_file_type(int(FILE_TYPES[file_type][0]))
    writer.add_quantization_version(2)
    for key, (value, vtype, sub_type) in default_tokenizer_metadata().items():
        writer.add_key_value(key, value, vtype, sub_type)


def _byte_shape(spec: TensorSpec) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[spec.qtype]
    return (*spec.shape[:-1], spec.shape[-1] // block * type_size)


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(_byte_shape(spec))


def _tensor_data(specs: list[TensorSpec], s: Shape, rng: np.random.Generator) -> Iterator[Any]:
    """Each tensor's bytes, made when the writer asks for it."""
    for spec in specs:
        if spec.name == "rope_freqs.weight":
            yield _llama3_rope_factors(s).view(np.uint8)
        elif spec.name.endswith("norm.weight"):  # about 1, so a norm loaded wrong shows
            yield (1 + rng.standard_normal(spec.shape, np.float32) * NORM_STD).view(np.uint8)
        elif len(spec.shape) == 1:  # a bias
            yield (rng.standard_normal(spec.shape, np.float32) * WEIGHT_STD).view(np.uint8)
        else:
            yield random_matrix(spec.shape, spec.qtype, rng).reshape(_byte_shape(spec))


def random_matrix(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The bytes of a `qtype` matrix whose values have mean ~0 and std WEIGHT_STD."""
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal(shape, np.float32) * np.float32(WEIGHT_STD)
        if qtype == Q.F32:
            return values.view(np.uint8)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16
    blocks = _random_blocks(qtype, math.prod(shape) // GGML_QUANT_SIZES[qtype][0], rng)
    _set_scales(blocks, qtype, WEIGHT_STD / _unit_std(qtype))
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        # The quantizer's d takes the sign of the block's largest value: half are negative,
        # which centres the values that the forced extreme quant would otherwise shift.
        blocks[rng.random(len(blocks)) < 0.5, 1] ^= 0x80  # the fp16 sign bit
    return blocks


def _random_blocks(qtype: Q, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with the extremes llama.cpp's quantizer always writes: it scales each
    block to its largest value, so a Q8_0 block holds a quant of 127 and a Q4_0 block one of
    0 (-8 d), and a Q4_1 block spans 0..15. pdserve's loader recognizes such blocks by them
    and keeps their weights compact (panel_codec.py); fully random quants would not be."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    data = rng.bytes(num_blocks * type_size)
    blocks = np.frombuffer(data, np.uint8).reshape(num_blocks, type_size).copy()
    if qtype == Q.Q8_0:
        quants = blocks[:, 2:]  # after the fp16 d
        quants[quants == 0x80] = 0x81  # the quantizer's range is -127..127, never -128
        quants[:, 0] = 127
    elif qtype == Q.Q4_0:
        blocks[:, 2] &= 0xF0  # quant 0 in the low nibble of the first byte
    elif qtype == Q.Q4_1:
        blocks[:, 4] &= 0xF0  # quant 0 = 0, quant 1 = 15 (after d and m)
        blocks[:, 5] |= 0x0F
    return blocks


# Where each type's fp16 scale (d) and, for the types with one, its offset scale (m or dmin) sit
# in a block, and the offset scale as a multiple of d that centres the values on 0: with random
# quants q and 6-bit sub-block scales and mins, E[d*sc*q] = E[dmin*min] when dmin = d*E[q].
SCALE_FIELDS: dict[Q, tuple[int, int | None, float]] = {
    Q.Q4_0: (0, None, 0.0),
    Q.Q4_1: (0, 2, -7.5),  # value = d*q + m, q in 0..15
    Q.Q5_0: (0, None, 0.0),
    Q.Q5_1: (0, 2, -15.5),
    Q.Q8_0: (0, None, 0.0),
    Q.Q4_K: (0, 2, 7.5),  # value = d*sc*q - dmin*min
    Q.Q5_K: (0, 2, 15.5),
    Q.Q6_K: (208, None, 0.0),  # value = d*sc*(q - 32), sc signed
}


def _set_scales(blocks: np.ndarray, qtype: Q, d: float) -> None:
    d_at, m_at, m_ratio = SCALE_FIELDS[qtype]
    blocks[:, d_at : d_at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if m_at is not None:
        m = np.float16(d * m_ratio).tobytes()
        blocks[:, m_at : m_at + 2] = np.frombuffer(m, np.uint8)


@cache
def _unit_std(qtype: Q) -> float:
    """The std of a `qtype` matrix's values at d = 1, measured by dequantizing random blocks."""
    from gguf.quants import dequantize

    blocks = _random_blocks(qtype, 4096, np.random.default_rng(1234))
    _set_scales(blocks, qtype, 1.0)
    values = dequantize(blocks.reshape(1, -1), qtype)
    return float(np.std(values))


def _llama3_rope_factors(s: Shape) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for Llama 3 rope scaling (its convert_hf_to_gguf.py)."""
    factor, low_freq_factor, high_freq_factor, old_context = s.llama3_rope_factor, 1.0, 4.0, 8192
    freqs = 1.0 / (s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim))
    wavelen = 2 * math.pi / freqs
    low_wavelen, high_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    return factors.astype(np.float32)


@cache
def default_tokenizer_metadata() -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """The default model's `tokenizer.*` keys: key -> (value, type, array element type)."""
    from gguf import GGUFReader

    from pdserve.model.registry import known_gguf_path

    reader = GGUFReader(known_gguf_path(DEFAULT_TOKENIZER_MODEL))
    keys = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            keys[key] = (field.contents(), vtype, sub_type)
    return keys


def default_vocab_size() -> int:
    return len(default_tokenizer_metadata()["tokenizer.ggml.tokens"][0])
