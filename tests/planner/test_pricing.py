"""Pricing the candidates' parts from the online cost model (pdserve/planner/pricing.py)."""

from __future__ import annotations

import pytest

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.pricing import queue_s
from tests.planner.conftest import truth


def test_a_queue_is_priced_in_chunk_sized_steps_the_model_spans():
    """A queue of 3,000 prompt tokens runs as 512-token chunks: a model that ran such chunks
    prices it as six of them, though it never ran a step of 3,000 tokens."""
    true = truth(4)
    rows = []
    for n in range(64, 513, 64):
        for decodes in (0, 4, 8):
            shape = StepShape(n, decodes, n * (n + 1) / 2, 300 * decodes, 1)
            rows.append([n, decodes, shape.prefill_attention_pairs, 300 * decodes, 1, 4])
            rows[-1].append(true.predict(shape))
    rows += [[0, b, 0, 300 * b, 0, 4, true.predict(StepShape(0, b, 0, 300 * b))] for b in (1, 4, 8)]
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("decode", rows)
    model.refit()
    assert model.step_s("decode", 4, StepShape(3001, 8, 3000 * 513 / 2, 2400)) is None
    chunk = true.predict(StepShape(513, 8, 1 + 512 * 513 / 2, 2400, 1))
    one = true.predict(StepShape(1, 8, 1, 2400, 1))
    expected = (chunk - one) * 3000 / 512
    assert queue_s(model, "decode", 4, 3000, 512, 8, 2400) == pytest.approx(expected, rel=1e-3)
