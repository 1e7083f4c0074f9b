"""A model whose matrices are read in place from a GGUF file (quant_linear.py): Llama (and
Mistral), Qwen2 (Q/K/V biases), Qwen3 (Q/K norms) and Phi-3 (fused QKV and gate|up).

The file is memory-mapped read-only (gguf_header.map_tensors maps it), and every matrix stays a view
of its bytes in the file's own block layout: loading copies only the norms and biases (a few KB
a layer) and allocates no fp32 weight at any point, and the page cache holds one copy of the
weights per host, shared by every worker that maps the same file (a prefill and a decode worker
on one machine read the same pages). Llama's Q and K rows keep llama.cpp's order in the file;
the kernels read them through a row map that undoes it (`_unpermute_rows`, transformers'
reverse permutation). Phi-3's `attn_qkv` ([q; k; v] rows) and `ffn_up` ([gate; up] rows) are
already the fused layout of our model (llama.py), so each is one part, read where it lies.

A tensor of a type the kernels do not read, and a tensor the model has no place for, are
refused by name at load, never widened or skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model import native
from pdserve.model.config import ModelConfig
from pdserve.model.gguf_convert import check_types
from pdserve.model.gguf_header import map_tensors
from pdserve.model.llama import DecoderLayer, LlamaForCausalLM
from pdserve.model.quant_linear import QuantEmbedding, QuantLinear, QuantTensor
from pdserve.model.rope import cos_sin_table

# Read into the config at conversion (Llama 3's rope scaling), not into a weight.
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


class FileTensors:
    """The tensors of one mapped GGUF file, handed out once each as the model takes them."""

    def __init__(self, reader: Any, lib: Any, path: Path) -> None:
        self.lib, self.path = lib, path
        self.architecture = str(reader.metadata["general.architecture"])
        self.tensors = {t.name: t for t in reader.tensors}
        self.taken: set[str] = set(CONFIG_TENSORS)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def quant(self, name: str, rowmap: torch.Tensor | None = None) -> QuantTensor:
        """The matrix `name` as a view of the file's bytes (no copy)."""
        if name not in self.tensors:
            raise ValueError(f"{self.path}: missing tensor {name}")
        self.taken.add(name)
        t = self.tensors[name]
        cols = int(t.shape[0])
        rows = int(t.n_elements) // cols
        data = t.data.view(np.uint8).reshape(rows, -1)
        return QuantTensor(data, int(t.tensor_type), rows, cols, name, rowmap)

    def vector(self, name: str, rowmap: torch.Tensor | None = None) -> torch.Tensor:
        """The 1-D tensor `name` (a norm or a bias) as an fp32 copy, in `rowmap`'s order."""
        t = self.quant(name)
        if t.rows != 1 and t.cols != 1:
            raise ValueError(f"{self.path}: tensor {name} is not a vector")
        values = t.dequantize_rows(self.lib, 0, t.rows).reshape(-1)
        return (values if rowmap is None else values[rowmap]).clone()

    def check_all_taken(self) -> None:
        unused = sorted(set(self.tensors) - self.taken)
        if unused:
            raise ValueError(f"{self.path}: tensors pdserve does not use: {unused[:5]}")


def load_gguf_model(gguf_path: Path, cfg: ModelConfig, device: str = "cpu") -> LlamaForCausalLM:
    """The model of `cfg` with its weights read from `gguf_path` in place (CPU, fp32 math)."""
    # A file of Q4_0/Q4_1/Q8_0/F32 matrices can be converted to fp32 instead, which runs anywhere.
    convert = "or a Q4_0/Q4_1/Q8_0 file converted to fp32 with --gguf-fp32-max-bytes past its size"
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"{gguf_path}: GGUF weights read in place run on the CPU, not on {device} ({convert})"
        )
    lib = native.load()
    if lib is None:
        raise ValueError(
            f"{gguf_path}: GGUF weights read in place need the native CPU kernels (a C compiler "
            f"and an AVX2 CPU; see docs/cpu-kernels.md), {convert}"
        )
    reader = map_tensors(gguf_path)
    check_types(reader.tensors, gguf_path)
    tensors = FileTensors(reader, lib, gguf_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for i, layer in enumerate(model.layers):
        load_layer(layer, tensors, cfg, f"blk.{i}.")
    model.norm.weight = _param(tensors.vector("output_norm.weight"))
    model.embed_tokens = QuantEmbedding(lib, tensors.quant("token_embd.weight"))
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    model.lm_head = QuantLinear(lib, [tensors.quant(head)])
    tensors.check_all_taken()
    model.rope_cos, model.rope_sin = cos_sin_table(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    model.gguf_reader = reader  # keeps the mapping open as long as the model lives
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"{gguf_path}: no weights for {missing[:5]}")
    return model.eval().requires_grad_(False)


def load_layer(layer: DecoderLayer, tensors: FileTensors, cfg: ModelConfig, b: str) -> None:
    """Layer `b` ("blk.N.") of any family: its matrices in place, its norms and biases copied."""
    attn, mlp, lib = layer.self_attn, layer.mlp, tensors.lib
    attn.qkv_proj = _qkv_proj(tensors, cfg, b)
    attn.o_proj = QuantLinear(lib, [tensors.quant(b + "attn_output.weight")])
    if cfg.qk_norm:  # Qwen3
        attn.q_norm.weight = _param(tensors.vector(b + "attn_q_norm.weight"))
        attn.k_norm.weight = _param(tensors.vector(b + "attn_k_norm.weight"))
    if tensors.has(b + "ffn_gate.weight"):
        gate_up = [tensors.quant(b + "ffn_gate.weight"), tensors.quant(b + "ffn_up.weight")]
    else:  # Phi-3: ffn_up holds [gate; up], the rows of our fused gate_up_proj
        gate_up = [tensors.quant(b + "ffn_up.weight")]
    if sum(t.rows for t in gate_up) != 2 * cfg.intermediate_size:
        raise ValueError(f"{tensors.path}: {b}ffn_* rows do not match feed_forward_length")
    mlp.gate_up_proj = QuantLinear(lib, gate_up)
    mlp.down_proj = QuantLinear(lib, [tensors.quant(b + "ffn_down.weight")])
    layer.input_layernorm.weight = _param(tensors.vector(b + "attn_norm.weight"))
    layer.post_attention_layernorm.weight = _param(tensors.vector(b + "ffn_norm.weight"))


def _qkv_proj(tensors: FileTensors, cfg: ModelConfig, b: str) -> QuantLinear:
    """Q, K and V as one linear: three parts, or Phi-3's one fused `attn_qkv`. Only llama
    files have llama.cpp's Q/K row permutation (its converter applies it to llama alone)."""
    if tensors.has(b + "attn_qkv.weight"):
        fused = tensors.quant(b + "attn_qkv.weight")
        if fused.rows != (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim:
            raise ValueError(f"{tensors.path}: {b}attn_qkv.weight rows do not match the heads")
        return QuantLinear(tensors.lib, [fused])
    maps: list[torch.Tensor | None] = [None, None, None]
    if tensors.architecture == "llama":
        maps[0] = _unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
        maps[1] = _unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    names = [b + f"attn_{x}" for x in "qkv"]
    parts = [tensors.quant(n + ".weight", m) for n, m in zip(names, maps, strict=True)]
    bias = None
    if cfg.attention_bias:  # Qwen2
        biases = [tensors.vector(n + ".bias", m) for n, m in zip(names, maps, strict=True)]
        bias = torch.cat(biases)
    return QuantLinear(tensors.lib, parts, bias)


def _param(values: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(values, requires_grad=False)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """For each row of the Hugging Face layout, the row of llama.cpp's Q/K layout holding it
    (transformers' `_reverse_permute_weights` applied to row numbers)."""
    dim = rows // heads // 2
    order = np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)
    return torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))


def weights_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory's model reads in place, or None (safetensors)."""
    from pdserve.model.gguf_convert import SOURCE_MARKER

    marker = Path(model_dir) / SOURCE_MARKER
    if not marker.is_file():
        return None
    recorded = json.loads(marker.read_text())
    return Path(recorded["gguf_path"]) if recorded.get("weights") == "in_place" else None
