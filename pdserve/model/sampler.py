"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A sampled row draws one uniform number and takes the token where it falls in the row's
cumulative distribution (inverse CDF), found in two levels: sums of blocks of
`CDF_BLOCK` probabilities, then the chosen block's own cumulative sum, both in float64. The
exponential race (argmax of p_i / E_i over E_i ~ Exp(1), as vLLM samples) needs a random
number per vocabulary entry; on a CPU that was 0.9 ms a row at a 49k vocabulary, 42 ms at
batch 32, more than the decode step itself. One number per row, no full-length scan and no
new [B, V] tensors take 5-15x less time (docs/cpu-kernels.md, "Sampling").

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
    """logits [B, V] fp32 -> one token id per row; the logits are overwritten when every row
    samples. `argmax`, if given, replaces `logits.argmax(-1)` (the native kernels'
    multi-threaded one on CPU)."""
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if row.temperature != 0.0]
    if not drawn:
        return tokens.tolist()
    temperatures = torch.tensor([rows[i].temperature for i in drawn], dtype=logits.dtype)
    # In place, in the caller's logits where every row samples: a new [B, V] tensor per step
    # costs its page faults (0.5-3 ms a pass at batch 32 here, more than the arithmetic).
    scaled = logits if len(drawn) == len(rows) else logits[drawn]
    scaled.div_(temperatures.to(logits.device)[:, None])
    for j, i in enumerate(drawn):
        row = rows[i]
        if 0 < row.top_k < logits.shape[-1] or row.top_p < 1.0:
            scaled[j] = filter_logits(scaled[j], row.top_k, row.top_p)
    uniforms = torch.cat(
        [
            torch.rand(
                1,
                dtype=torch.float64,
                generator=_generator(rows[i], fallback, logits.device),
                device=logits.device,
            )
            for i in drawn
        ]
    )
    # Unnormalized probabilities, in place (inverse_cdf takes any positive total).
    probs = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()
    tokens[drawn] = inverse_cdf(probs, uniforms)
    return tokens.tolist()


CDF_BLOCK = 256  # probabilities per first-level block: 192 blocks at a 49,152 vocabulary


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` [S, V] (non-negative, any positive total) and its uniform
    number in [0, 1) (`uniforms` [S], float64): the index k with cdf[k-1] <= u * total <
    cdf[k], so token k is drawn with probability probs[k] / total and a zero-probability
    token never is."""
    num_rows, vocab = probs.shape
    if vocab % CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, CDF_BLOCK - vocab % CDF_BLOCK))
    blocks = probs.view(num_rows, -1, CDF_BLOCK)
    # Block sums in float32 (pairwise, ~1e-7 relative, as the softmax itself), then float64.
    block_cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)  # [S, num_blocks]
    total = block_cdf[:, -1]
    # u * total < total, even where the product rounds up to it.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(1)
    previous = block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0]
    before = torch.where(block > 0, previous, 0.0)
    chosen = blocks[torch.arange(num_rows, device=probs.device), block]  # [S, CDF_BLOCK]
    inner_cdf = chosen.to(torch.float64).cumsum(-1)
    inner = torch.searchsorted(inner_cdf, (target - before)[:, None], right=True).squeeze(1)
    # Rounding may leave the target at or past the block's own cumulative sum (it was summed
    # in another order): then its last token with a positive probability is the one.
    last_positive = CDF_BLOCK - 1 - (chosen > 0).flip(-1).to(torch.int8).argmax(-1)
    inner = torch.where(inner >= CDF_BLOCK, last_positive, inner)
    return block * CDF_BLOCK + inner
