"""Shared fixtures: tiny random-weight Llama checkpoints in Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def make_tiny_llama(path: Path, **overrides) -> Path:
    """Save a random-weight LlamaForCausalLM (fp32, seeded) as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    # Scale weights up a little so logits are well separated (greedy ties would make
    # token-for-token comparisons meaningless).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory) -> Path:
    """A tiny model that also carries a byte-level tokenizer with a chat template, so the
    whole stack (tokenizer, router, CLI) runs on it in seconds."""
    from tests.router.harness import write_tiny_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("served"), vocab_size=320, eos_token_id=2)
    write_tiny_tokenizer(path)
    return path
