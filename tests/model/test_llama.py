"""Our Llama equals Hugging Face transformers' LlamaForCausalLM on the same weights."""

import pytest
import torch

from pdserve.model.attention import AttentionMetadata, PrefillSpan
from pdserve.model.kv_cache import layer_caches
from pdserve.model.loader import load_model
from tests.conftest import make_tiny_llama


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    bs, n = 4, len(ids)
    num_blocks = -(-n // bs)
    kv = torch.zeros(cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, bs, cfg.head_dim)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        pos // bs, pos % bs, prefills=[PrefillSpan(0, n, 0, torch.arange(num_blocks))]
    )
    return model.compute_logits(model(torch.tensor(ids), pos, layer_caches(kv, "auto"), meta))


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["untied", "tied", "rope-linear", "rope-llama3"],
)
def test_logits_match_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path, **overrides)
    ids = [3, 17, 99, 4, 56, 2, 81, 33, 7, 120, 64, 5, 9]
    torch.testing.assert_close(
        our_logits(load_model(model_dir), ids), hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4
    )


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_llama(tmp_path)
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(model_dir)


def test_corrupt_weights_file(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    next(model_dir.glob("*.safetensors")).write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="corrupt weights file"):
        load_model(model_dir)
