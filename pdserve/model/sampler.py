"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws token i from a generator seeded with (seed, i), so its output does
not depend on which other requests share the batch, nor on preemption and recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    output_index: int  # how many tokens the request has produced so far


_MASK64 = (1 << 63) - 1


def _generator(row: SamplingRow, fallback: torch.Generator, device: torch.device):
    if row.seed is None:
        return fallback
    seed = (row.seed * 1_000_003 + row.output_index) & _MASK64
    return torch.Generator(device=device).manual_seed(seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; logits [V], already temperature-scaled."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    fallback: torch.Generator,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """logits [B, V] fp32 -> one token id per row. `argmax`, if given, replaces
    `logits.argmax(-1)` (the native kernels' multi-threaded one on CPU)."""
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        if row.temperature == 0.0:
            continue
        scaled = filter_logits(logits[i] / row.temperature, row.top_k, row.top_p)
        probs = scaled.softmax(-1)
        # Exponential race (Gumbel-max in another form): argmax p_i / E_i, E_i ~ Exp(1).
        noise = torch.empty_like(probs).exponential_(
            generator=_generator(row, fallback, probs.device)
        )
        tokens[i] = torch.argmax(probs / noise)
    return tokens.tolist()
