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

The header is parsed here, not through `safetensors.safe_open(framework="numpy")`, because its
`get_tensor` copies: reading a 200 MB fp32 tensor raised the process's RSS by 381 MB
(safetensors 0.8.0).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.quant_linear import QuantEmbedding, QuantLinear, QuantTensor
from pdserve.model.rope import cos_sin_table

# safetensors dtype -> (ggml type id the kernels read, torch dtype of the values).
KERNEL_TYPES = {"F32": (0, torch.float32), "F16": (1, torch.float16), "BF16": (30, torch.bfloat16)}
# The format caps a header at 100 MB; a longer one is no safetensors header.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class Entry:
    """One tensor of a mapped file: its safetensors dtype name, shape and bytes (a read-only
    uint8 view of the file's mapping, which it keeps open)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def map_checkpoint(model_dir: Path) -> dict[str, Entry]:
    """Every tensor of the directory's *.safetensors files (one file or the shards of one
    checkpoint), each a view of its file's read-only mapping; ValueError naming the file."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    entries: dict[str, Entry] = {}
    for path in files:
        for name, entry in map_file(path).items():
            if name in entries:
                raise ValueError(f"{path}: tensor {name} is also in another weights file")
            entries[name] = entry
    return entries


def map_file(path: Path) -> dict[str, Entry]:
    """One .safetensors file's tensors as views of its read-only mapping."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if not 0 < header_len <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {header_len}")
            header = json.loads(f.read(header_len))
        mapped = np.memmap(path, np.uint8, mode="r")
        header.pop("__metadata__", None)
        return {name: _entry(info, mapped, 8 + header_len) for name, info in sorted(header.items())}
    except (OSError, ValueError, struct.error, AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt weights file {path}: {e}") from None


def _entry(info: dict[str, Any], mapped: np.ndarray, start: int) -> Entry:
    begin, end = (int(x) for x in info["data_offsets"])
    shape = tuple(int(x) for x in info["shape"])
    dtype = str(info["dtype"])
    if not 0 <= begin <= end <= mapped.size - start or min(shape, default=1) < 0:
        raise ValueError(f"bytes [{begin}, {end}) of shape {list(shape)} lie outside the file")
    if dtype in KERNEL_TYPES:
        itemsize = KERNEL_TYPES[dtype][1].itemsize
        if end - begin != itemsize * math.prod(shape):
            raise ValueError(f"{end - begin} bytes do not hold a {dtype} {list(shape)}")
    return Entry(dtype, shape, mapped[start + begin : start + end])


def reads_in_place(entries: dict[str, Entry]) -> bool:
    """The rule: a checkpoint whose matrices are all of a type the kernels read (BF16, F16,
    F32) and not all F32 is read in place. An fp32 checkpoint loads as fp32 tensors (the
    panel kernels and oneDNN run it; the tiny models tests compare to transformers are fp32);
    one of other types (F64, FP8, ...) is converted to fp32 by loader.py."""
    types = {e.dtype for e in entries.values() if len(e.shape) == 2}
    return bool(types) and types <= KERNEL_TYPES.keys() and types != {"F32"}


def in_place_bytes(model_dir: Path) -> int:
    """The bytes of the matrices a worker of `model_dir` maps in place (0: none: it loads the
    checkpoint as fp32), for memory estimates; headers are read, no weight."""
    entries = map_checkpoint(model_dir)
    if not reads_in_place(entries):
        return 0
    return sum(e.data.nbytes for e in entries.values() if len(e.shape) == 2)


class _Weights:
    """The checkpoint's tensors by Hugging Face name, each taken once (what is left at the end
    is a tensor pdserve does not use)."""

    def __init__(self, entries: dict[str, Entry], model_dir: Path) -> None:
        self.entries, self.model_dir = dict(entries), model_dir

    def take(self, name: str) -> Entry:
        try:
            return self.entries.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint in {self.model_dir} lacks the tensor {name!r}") from None

    def matrix(self, name: str) -> QuantTensor:
        entry = self.take(name)
        if len(entry.shape) != 2 or entry.dtype not in KERNEL_TYPES:
            raise ValueError(f"{self.model_dir}: tensor {name} is a {entry.dtype} "
                             f"{list(entry.shape)}, not a BF16, F16 or F32 matrix")  # fmt: skip
        rows, cols = entry.shape
        qtype, dtype = KERNEL_TYPES[entry.dtype]
        data = entry.data.reshape(rows, cols * dtype.itemsize)
        return QuantTensor(data, qtype, rows, cols, name)

    def vector(self, name: str) -> torch.Tensor:
        """A norm's or bias's values, copied to fp32."""
        entry = self.take(name)
        if len(entry.shape) != 1 or entry.dtype not in KERNEL_TYPES:
            raise ValueError(f"{self.model_dir}: tensor {name} is a {entry.dtype} "
                             f"{list(entry.shape)}, not a BF16, F16 or F32 vector")  # fmt: skip
        raw = torch.frombuffer(bytearray(entry.data), dtype=KERNEL_TYPES[entry.dtype][1])
        return raw.float()

    def fused(self, prefix: str, fused: str, parts: list[str]) -> list[QuantTensor]:
        """Phi-3 ships qkv_proj and gate_up_proj fused; the others separate."""
        if prefix + fused in self.entries:
            return [self.matrix(prefix + fused)]
        return [self.matrix(prefix + part) for part in parts]

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


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)
