"""KV token dropping under a budget: which blocks of a sequence to free. Torch-free.

A sequence over its budget frees whole blocks, those whose tokens received the least
attention so far (accumulated by the model runner), never the first `sink_blocks` (attention
sinks: the first tokens draw attention whatever they say) nor the `recent_blocks` before the
block being filled (local context). RoPE was applied to each key at its original position
when it was written, so the kept keys stay correct after their neighbours are gone.

    blocks:  [sink | ...droppable, lowest score first... | recent | filling]

Disaggregated, a prompt already over budget when it lands is dropped *before* the transfer
(`PromptDrop`): the decode worker reserves only the blocks it will keep, the prefill worker
picks them with the same arithmetic and sends only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DropPolicy:
    budget_blocks: int
    sink_blocks: int = 1
    recent_blocks: int = 4

    def __post_init__(self) -> None:
        least = self.sink_blocks + self.recent_blocks + 2
        if self.budget_blocks < least:
            raise ValueError(
                f"a KV budget of {self.budget_blocks} blocks leaves nothing to drop from: it must "
                f"be at least {least} blocks (sink {self.sink_blocks} + recent "
                f"{self.recent_blocks} + 2)"
            )

    def prompt_drop(self, num_prompt_tokens: int, block_size: int) -> PromptDrop | None:
        """What a freshly prefilled prompt keeps, or None when it fits: the same decision
        `blocks_to_drop` makes right after the prompt's last chunk (the first token is the
        next one to get KV), so nothing more has to go right after it lands."""
        num_blocks = -(-num_prompt_tokens // block_size)
        keep = num_blocks_kept(num_blocks, num_prompt_tokens % block_size == 0, self)
        if keep >= num_blocks:
            return None
        return PromptDrop(keep, self.sink_blocks, self.recent_blocks)


@dataclass(frozen=True)
class PromptDrop:
    """A prompt dropped before its KV is transferred: of its blocks, keep the sink, the
    recent ones and the block with the last token, plus the highest-scored others, so that
    `num_keep_blocks` remain (every dropped block is full: the last block is always kept)."""

    num_keep_blocks: int
    sink_blocks: int
    recent_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_keep_blocks", "sink_blocks", "recent_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        least = self.sink_blocks + self.recent_blocks + 1
        if self.num_keep_blocks < least:
            raise ValueError(
                f"num_keep_blocks {self.num_keep_blocks} must be at least {least} (sink "
                f"{self.sink_blocks} + recent {self.recent_blocks} + the last block)"
            )

    def num_dropped_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
        num_blocks = -(-num_prompt_tokens // block_size)
        return (num_blocks - self.num_keep_blocks) * block_size

    def kept(self, scores: Sequence[float]) -> list[int]:
        """Indices of the blocks kept, ascending, for a prompt of `len(scores)` blocks."""
        if self.num_keep_blocks >= len(scores):
            raise ValueError(
                f"keeping {self.num_keep_blocks} of {len(scores)} prompt blocks drops nothing"
            )
        num_victims = len(scores) - self.num_keep_blocks
        victims = set(lowest_scored(scores, num_victims, self.sink_blocks, self.recent_blocks))
        return [i for i in range(len(scores)) if i not in victims]


def over_budget(num_tokens: int, budget_tokens: int, block_size: int) -> bool:
    """Whether a sequence whose `num_tokens` all have KV must drop before its next token:
    the blocks for one more token exceed the budget (`blocks_to_drop` frees some)."""
    return -(-(num_tokens + 1) // block_size) > budget_tokens // block_size


def num_blocks_kept(num_blocks: int, next_needs_block: bool, policy: DropPolicy) -> int:
    """How many of a sequence's `num_blocks` stay: all within budget, else the budget less
    the block the next token opens (if it opens one)."""
    return min(num_blocks, policy.budget_blocks - (1 if next_needs_block else 0))


def blocks_to_drop(
    scores: Sequence[float], next_needs_block: bool, policy: DropPolicy
) -> list[int]:
    """Indices (into the sequence's block list, `len(scores)` blocks) to free so that the
    next token still fits within the budget; ascending order."""
    excess = len(scores) - num_blocks_kept(len(scores), next_needs_block, policy)
    if excess <= 0:
        return []
    return lowest_scored(scores, excess, policy.sink_blocks, policy.recent_blocks)


def lowest_scored(
    scores: Sequence[float], num_victims: int, sink_blocks: int, recent_blocks: int
) -> list[int]:
    """The `num_victims` lowest-scored blocks outside the sink and recent ones; ascending."""
    # The last block is the one being filled (or the next token's, already full): keep it too.
    candidates = range(sink_blocks, len(scores) - recent_blocks - 1)
    victims = sorted(candidates, key=lambda i: (scores[i], i))[:num_victims]
    return sorted(victims)
