"""A Llama model whose matrices are read in place from a Hugging Face checkpoint's
.safetensors files, for bf16 and fp16 checkpoints (`reads_in_place` is the rule).

A .safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the tensors, row-major: a matrix [out, in] is the row
layout the GGUF kernels read for their F32/F16/BF16 types (quant_linear.py). Each file is
memory-mapped read-only and every matrix stays a view of its bytes, wrapped as the `QuantTensor`
the GGUF path uses, so the same kernels serve it (fp32 arithmetic on the checkpoint's values);
only the norms and biases (a few KB a layer) are copied, to fp32. Loading allocates no fp32
weight at any point, and the page cache holds one copy of the weights per host, shared by every
worker that maps the same files. Q/K rows are in Hugging Face's order already (no row map).
The files are parsed and mapped by safetensors_header.py.

The fallback: a matrix of a float type the kernels cannot read (F64, FP8:
safetensors_header.WIDENED_TYPES) is widened to an fp32 copy of the worker's own. Each such
matrix is logged at load, named with its type, and counted in the model's `widened_weights`
(the worker's Stats `weights_widened`: /v1/status and `pdserve_weights_widened_total`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.quant_linear import QuantEmbedding, QuantLinear, QuantTensor
from pdserve.model.rope import cos_sin_table
from pdserve.model.safetensors_header import KERNEL_TYPES, WIDENED_TYPES, Entry

log = logging.getLogger(__name__)

# safetensors dtype -> torch's, for the tensors copied to fp32.
TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
F32 = KERNEL_TYPES["F32"][0]


class _Weights:
    """The checkpoint's tensors by Hugging Face name, each taken once (what is left at the end
    is a tensor pdserve does not use)."""

    def __init__(self, entries: dict[str, Entry], model_dir: Path) -> None:
        self.entries, self.model_dir = dict(entries), model_dir
        self.widened: dict[str, str] = {}  # matrix name -> why it was widened to fp32

    def take(self, name: str) -> Entry:
        try:
            return self.entries.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint in {self.model_dir} lacks the tensor {name!r}") from None

    def matrix(self, name: str) -> QuantTensor:
        """A matrix as a view of its mapped bytes, or (WIDENED_TYPES) an fp32 copy, counted."""
        entry = self.take(name)
        if len(entry.shape) != 2 or entry.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"{self.model_dir}: tensor {name} is a {entry.dtype} "
                f"{list(entry.shape)}, not a BF16, F16 or F32 matrix"
            )
        rows, cols = entry.shape
        if entry.dtype in WIDENED_TYPES:
            self.widened[name] = f"dtype_{entry.dtype}"
            data = _widened(entry).numpy().view(np.uint8).reshape(rows, cols * 4)
            return QuantTensor(data, F32, rows, cols, name)
        qtype, itemsize = KERNEL_TYPES[entry.dtype]
        data = entry.data.reshape(rows, cols * itemsize)
        return QuantTensor(data, qtype, rows, cols, name)

    def vector(self, name: str) -> torch.Tensor:
        """A norm's or bias's values, copied to fp32."""
        entry = self.take(name)
        if len(entry.shape) != 1 or entry.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"{self.model_dir}: tensor {name} is a {entry.dtype} "
                f"{list(entry.shape)}, not a BF16, F16 or F32 vector"
            )
        return _widened(entry)

    def fused(self, prefix: str, fused: str, parts: list[str]) -> list[QuantTensor]:
        """Phi-3 ships qkv_proj and gate_up_proj fused; the others separate."""
        if prefix + fused in self.entries:
            return [self.matrix(prefix + fused)]
        return [self.matrix(prefix + part) for part in parts]

    def log_widened(self) -> None:
        """One line at load naming every widened matrix and why (none: nothing logged)."""
        if self.widened:
            log.warning(
                "%s: %d matrices widened to fp32, each worker's own copy (the in-place kernels "
                "read BF16, F16 and F32): %s",
                self.model_dir,
                len(self.widened),
                ", ".join(f"{name} ({why})" for name, why in self.widened.items()),
            )

    def check_all_taken(self) -> None:
        leftover = [k for k in self.entries if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"checkpoint has tensors pdserve does not use: {leftover[:5]}")


def load_safetensors_model(
    entries: dict[str, Entry], cfg: ModelConfig, lib: Any, model_dir: Path
) -> LlamaForCausalLM:
    """The model of `cfg` with its matrices read in place from the mapped `entries` (CPU, fp32
    math); `lib` is the loaded native kernels."""
    weights = _Weights(entries, model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for i, layer in enumerate(model.layers):
        _load_layer(weights, f"model.layers.{i}.", layer, cfg, lib)
    model.norm.weight = _param(weights.vector("model.norm.weight"))
    embedding = weights.matrix("model.embed_tokens.weight")
    model.embed_tokens = QuantEmbedding(lib, embedding)
    head = embedding if cfg.tie_word_embeddings else weights.matrix("lm_head.weight")
    weights.entries.pop("lm_head.weight", None)  # a tied checkpoint may carry a copy
    model.lm_head = QuantLinear(lib, [head])
    weights.check_all_taken()
    weights.log_widened()
    model.widened_weights = weights.widened
    model.rope_cos, model.rope_sin = cos_sin_table(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:5]}")
    return model.eval().requires_grad_(False)


def _load_layer(w: _Weights, prefix: str, layer: torch.nn.Module, cfg: ModelConfig, lib) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [f"self_attn.{x}_proj.weight" for x in "qkv"]
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([w.vector(prefix + f"self_attn.{x}_proj.bias") for x in "qkv"])
    attn.qkv_proj = QuantLinear(lib, w.fused(prefix, "self_attn.qkv_proj.weight", qkv), bias)
    attn.o_proj = QuantLinear(lib, [w.matrix(prefix + "self_attn.o_proj.weight")])
    gate_up = ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    mlp.gate_up_proj = QuantLinear(lib, w.fused(prefix, "mlp.gate_up_proj.weight", gate_up))
    mlp.down_proj = QuantLinear(lib, [w.matrix(prefix + "mlp.down_proj.weight")])
    layer.input_layernorm.weight = _param(w.vector(prefix + "input_layernorm.weight"))
    layer.post_attention_layernorm.weight = _param(
        w.vector(prefix + "post_attention_layernorm.weight")
    )
    if cfg.qk_norm:
        attn.q_norm.weight = _param(w.vector(prefix + "self_attn.q_norm.weight"))
        attn.k_norm.weight = _param(w.vector(prefix + "self_attn.k_norm.weight"))


def _widened(entry: Entry) -> torch.Tensor:
    """A tensor's values copied to fp32."""
    raw = torch.frombuffer(bytearray(entry.data), dtype=TORCH_DTYPES[entry.dtype])
    return raw.float().reshape(entry.shape)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)
