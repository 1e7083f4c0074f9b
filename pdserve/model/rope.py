"""Rotary position embeddings (rotate-half form, as in Hugging Face's Llama), with the
checkpoint's theta and its `linear` or `llama3` frequency scaling, or llama.cpp's per-frequency
divisors (`freq_factors`: the `rope_freqs.weight` tensor its Llama 3 GGUFs carry, which is the
llama3 scaling precomputed: llama3's inv_freq = inv_freq / factor, frequency by frequency)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as Hugging Face computes it, so positions far out round the same way.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope freq_factors has {factors.numel()} values; head_dim {head_dim} needs "
                f"{inv_freq.numel()}"
            )
        return inv_freq / factors
    raise ValueError(
        f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, freq_factors)"
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def cos_sin_table(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim], fp32."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
