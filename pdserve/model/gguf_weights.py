"""A Llama model whose matrices are read in place from a GGUF file (quant_linear.py).

The file is memory-mapped read-only (gguf.GGUFReader maps it), and every matrix stays a view
of its bytes in the file's own block layout: loading copies only the norms (a few KB a layer)
and allocates no fp32 weight at any point, and the page cache holds one copy of the weights per
host, shared by every worker that maps the same file (a prefill and a decode worker on one
machine read the same pages). Q and K rows keep llama.cpp's order in the file; the kernels read
them through a row map that undoes it (`_unpermute_rows`, transformers' reverse permutation).

A tensor of a type the kernels do not read is refused by name at load, never widened.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pdserve.model import native
from pdserve.model.config import ModelConfig
from pdserve.model.gguf_convert import check_types
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.quant_linear import QuantEmbedding, QuantLinear, QuantTensor
from pdserve.model.rope import cos_sin_table


def load_gguf_model(gguf_path: Path, cfg: ModelConfig, device: str = "cpu") -> LlamaForCausalLM:
    """The model of `cfg` with its weights read from `gguf_path` in place (CPU, fp32 math)."""
    from gguf import GGUFReader

    if torch.device(device).type != "cpu":
        raise ValueError(f"{gguf_path}: quantized GGUF weights run on the CPU, not on {device}")
    lib = native.load()
    if lib is None:
        raise ValueError(
            f"{gguf_path}: quantized GGUF weights need the native CPU kernels (a C compiler "
            "and an AVX2 CPU); see docs/cpu-kernels.md"
        )
    reader = GGUFReader(gguf_path, "r")
    check_types(reader.tensors, gguf_path)
    tensors = {t.name: t for t in reader.tensors}

    def quant(name: str, rowmap: torch.Tensor | None = None) -> QuantTensor:
        if name not in tensors:
            raise ValueError(f"{gguf_path}: missing tensor {name}")
        t = tensors[name]
        cols = int(t.shape[0])
        rows = int(t.n_elements) // cols
        data = t.data.view(np.uint8).reshape(rows, -1)
        return QuantTensor(data, int(t.tensor_type), rows, cols, name, rowmap)

    def vector(name: str) -> torch.Tensor:
        t = quant(name)
        if t.rows != 1 and t.cols != 1:
            raise ValueError(f"{gguf_path}: tensor {name} is not a vector")
        return t.dequantize_rows(lib, 0, t.rows).reshape(-1).clone()

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    q_map = _unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    k_map = _unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = QuantLinear(
            lib, [quant(b + "attn_q.weight", q_map), quant(b + "attn_k.weight", k_map),
                  quant(b + "attn_v.weight")],
        )  # fmt: skip
        attn.o_proj = QuantLinear(lib, [quant(b + "attn_output.weight")])
        mlp.gate_up_proj = QuantLinear(
            lib, [quant(b + "ffn_gate.weight"), quant(b + "ffn_up.weight")]
        )
        mlp.down_proj = QuantLinear(lib, [quant(b + "ffn_down.weight")])
        layer.input_layernorm.weight = torch.nn.Parameter(vector(b + "attn_norm.weight"), False)
        layer.post_attention_layernorm.weight = torch.nn.Parameter(
            vector(b + "ffn_norm.weight"), False
        )
    model.norm.weight = torch.nn.Parameter(vector("output_norm.weight"), False)
    model.embed_tokens = QuantEmbedding(lib, quant("token_embd.weight"))
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    model.lm_head = QuantLinear(lib, [quant(head)])
    model.rope_cos, model.rope_sin = cos_sin_table(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    model.gguf_reader = reader  # keeps the mapping open as long as the model lives
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"{gguf_path}: no weights for {missing[:5]}")
    return model.eval().requires_grad_(False)


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
