"""Load a Hugging Face-format Llama checkpoint (config.json + *.safetensors) into our model.

GGUF files and known model names are first converted into such a directory by
`registry.resolve_model` (once, cached), so this is the only weight-loading path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pdserve.config import DTYPES
from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.rope import cos_sin_table


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return getattr(torch, name)


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weights file {path}: {e}") from None
    return tensors


def to_model_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: drop the `model.` prefix, fuse q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return hf.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint lacks the tensor {name!r}") from None

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{x}_proj.weight") for x in "qkv"]
        )
        if cfg.attention_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{x}_proj.bias") for x in "qkv"]
            )
        out[f"layers.{i}.self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{norm}.weight"] = take(p + f"{norm}.weight")
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
    state = to_model_state_dict(read_safetensors(model_dir), cfg)
    with torch.device("meta"):  # no memory for weights that are about to be replaced
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = cos_sin_table(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {missing[:5]}")
    return model.to(device=device, dtype=torch_dtype(dtype)).eval().requires_grad_(False)
