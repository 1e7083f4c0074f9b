"""KV token dropping under a budget: which blocks of a sequence to free. Torch-free.

A sequence over its budget frees whole blocks, those whose tokens received the least
attention so far (accumulated by the model runner), never the first `sink_blocks` (attention
sinks: the first tokens draw attention whatever they say) nor the `recent_blocks` before the
block being filled (local context). RoPE was applied to each key at its original position
when it was written, so the kept keys stay correct after their neighbours are gone.

    blocks:  [sink | ...droppable, lowest score first... | recent | filling]
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


def blocks_to_drop(
    scores: Sequence[float], next_needs_block: bool, policy: DropPolicy
) -> list[int]:
    """Indices (into the sequence's block list, `len(scores)` blocks) to free so that the
    next token still fits within the budget; ascending order."""
    limit = policy.budget_blocks - (1 if next_needs_block else 0)
    excess = len(scores) - limit
    if excess <= 0:
        return []
    # The last block is the one being filled (or the next token's, already full): keep it too.
    candidates = range(policy.sink_blocks, len(scores) - policy.recent_blocks - 1)
    victims = sorted(candidates, key=lambda i: (scores[i], i))[:excess]
    return sorted(victims)
