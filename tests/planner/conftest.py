"""A known machine for the planner's tests: true step costs per thread count, and the
StepReport rows a worker with them would send."""

from __future__ import annotations

import random

from pdserve.costmodel.step_cost import StepCostModel, StepShape

# seconds per: step, prefill token, decode, over knee, attention pair, context token, prefill row
BASE = [2e-3, 2e-4, 4e-4, 0.0, 2e-8, 4e-7, 1e-3]


def truth(threads: int) -> StepCostModel:
    """Four threads as fast as BASE; linear speed-up but the fixed cost."""
    c = [BASE[0], *(x * 4 / threads for x in BASE[1:])]
    return StepCostModel(c)


def rows(threads: int, n: int, seed: int = 0) -> list[list[float]]:
    """`n` StepReport rows of mixed steps (prefill chunks, decode batches, both)."""
    rng = random.Random(seed)
    model, out = truth(threads), []
    for _ in range(n):
        prefill = rng.choice([0, 0, rng.randint(16, 512)])
        decodes = rng.randint(0 if prefill else 1, 32)
        prior = rng.randint(0, 1024) if prefill else 0
        pairs = prefill * (prior + (prefill + 1) / 2)
        context = decodes * rng.randint(32, 1024)
        sequences = rng.randint(1, 3) if prefill else 0
        shape = StepShape(prefill, decodes, pairs, context, sequences)
        out.append([prefill, decodes, pairs, context, sequences, threads, model.predict(shape)])
    return out
