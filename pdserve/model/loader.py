"""Load a Hugging Face-format Llama checkpoint (config.json + *.safetensors) into our model.

GGUF files and known model names are first converted into such a directory by
`registry.resolve_model` (once, cached); a directory made for a GGUF whose matrices are read in
place from the file (K-quants and the other types of gguf_convert.reads_in_place) holds no
weights, and its model is built by gguf_weights.py.

A Hugging Face checkpoint of bf16 or fp16 matrices run with fp32 activations on the CPU is read
in place from its mapped files (safetensors_weights.py; the rule is
safetensors_header.reads_in_place); other checkpoints (fp32 ones, and any run on CUDA or in
another dtype) load as fp32 tensors here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pdserve.config import DTYPES
from pdserve.model import native
from pdserve.model.config import ModelConfig
from pdserve.model.gguf_weights import load_gguf_model, weights_source
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.rope import cos_sin_table
from pdserve.model.safetensors_header import checkpoint_files, map_checkpoint, reads_in_place
from pdserve.model.safetensors_weights import load_safetensors_model

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return getattr(torch, name)


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weights file {path}: {e}") from None
    return tensors


def to_model_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: drop the `model.` prefix, fuse q/k/v and gate/up (unless
    the checkpoint has them fused, as Phi-3's has)."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return hf.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint lacks the tensor {name!r}") from None

    qkv = [f"self_attn.{x}_proj.weight" for x in "qkv"]
    fused = {
        "self_attn.qkv_proj.weight": qkv,
        "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    }
    if cfg.attention_bias:
        fused["self_attn.qkv_proj.bias"] = [name.replace("weight", "bias") for name in qkv]
    kept = (
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    if cfg.qk_norm:
        kept += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    for i in range(cfg.num_layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        for name, parts in fused.items():
            if theirs + name in hf:  # Phi-3 ships qkv_proj and gate_up_proj already fused
                out[ours + name] = take(theirs + name)
                continue
            out[ours + name] = torch.cat([take(theirs + part) for part in parts])
        for name in kept:
            out[ours + name] = take(theirs + name)
    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    hf.pop("lm_head.weight", None)
    leftover = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"checkpoint has tensors pdserve does not use: {leftover[:5]}")
    return out


def load_model(model_dir: Path, device: str = "cpu", dtype: str = "float32") -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    if (gguf_path := weights_source(model_dir)) is not None:
        if dtype != "float32":
            raise ValueError(f"{gguf_path}: quantized GGUF weights run with dtype float32")
        return load_gguf_model(gguf_path, cfg, device)
    widened: dict[str, str] = {}  # the fallback: a checkpoint read in place, widened here
    if torch.device(device).type == "cpu" and dtype == "float32":
        entries = map_checkpoint(model_dir)
        if reads_in_place(entries):
            lib = native.load()
            if lib is not None:
                return load_safetensors_model(entries, cfg, lib, model_dir)
            log.warning(
                "%s: the native CPU kernels cannot run here (docs/cpu-kernels.md), so its "
                "bf16/fp16 weights are converted to fp32 in memory instead of read in place",
                model_dir,
            )
            widened = {n: "no_native_kernels" for n, e in entries.items() if len(e.shape) == 2}
    state = to_model_state_dict(read_safetensors(model_dir), cfg)
    with torch.device("meta"):  # no memory for weights that are about to be replaced
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, assign=True, strict=False)
    model.widened_weights = widened
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = cos_sin_table(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:5]}")
    return model.to(device=device, dtype=torch_dtype(dtype)).eval().requires_grad_(False)
