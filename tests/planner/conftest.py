"""A known machine for the planner's tests: true step costs per thread count, and the
StepReport rows a worker with them would send."""

from __future__ import annotations

import random

from pdserve.costmodel.profile import HardwareProfile, ModelShape
from pdserve.costmodel.step_cost import StepCostModel, StepShape, TransferModel

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


# Two cores, as the README's "When does disaggregation pay?" cells run (coefficients as
# BASE's, per thread count; no context cost). A 1B model (Llama 3.2 1B shape, Q4_1): a step
# of three decodes 0.5 s on two threads and 1.1 s on one, one decode 0.18 s on two (the
# derived stall budget: 10 x that, 1.8 s), a prompt token 5 ms on two.
ONE_B = {2: [0.02, 5e-3, 0.16, 0, 0, 0, 0], 1: [0.05, 1e-2, 0.35, 0, 0, 0, 0]}
# SmolLM2-135M: 8 ms a decode step on two threads, 16 ms on one; 1.2 ms a prompt token on two.
SMOLLM = {2: [4e-3, 1.2e-3, 4e-3, 0, 0, 0, 0], 1: [6e-3, 2.4e-3, 1e-2, 0, 0, 0, 0]}


def two_cores(coefficients: dict[int, list[float]]) -> HardwareProfile:
    """A measured profile of these step costs per thread count (a usable model at once)."""
    shape = ModelShape("test", 2, 64, 128, 4, 2, 16, 128, kv_bytes_per_element=4.0)
    return HardwareProfile(
        kind="measured",
        device="test",
        model=shape,
        size_unit="threads",
        models={t: StepCostModel(list(c)) for t, c in coefficients.items()},
        transfer={"tcp": TransferModel(512e6, 1e-4)},
        devices_per_node=1,
        kv_cache_bytes=65536 * shape.kv_bytes_per_token,
    )
