import math

import pytest

from pdserve.costmodel.step_cost import (
    FEATURES,
    GRAMMAR_ROW_S,
    StepCostModel,
    StepShape,
    fit_cost_model,
)
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams


def _request(num_prompt: int, num_computed: int, num_output: int = 0) -> Request:
    r = Request("r", list(range(num_prompt)), SamplingParams())
    r.num_computed_tokens = num_computed
    r.output_token_ids = [7] * num_output
    return r


def test_shape_of_a_mixed_step():
    # A decode row with 10 prompt + 3 output tokens (12 with KV) attends 13 tokens; a prefill
    # chunk of 4 after 8 cached tokens makes 4 * (8 + 2.5) query-key pairs.
    out = SchedulerOutput([(_request(10, 12, 3), 1), (_request(20, 8), 4)])
    shape = StepShape.of(out.scheduled)
    assert shape == StepShape(
        prefill_tokens=4,
        decode_requests=1,
        prefill_attention_pairs=42.0,
        decode_context_tokens=13,
        prefill_sequences=1,
    )
    two = StepShape.of([(_request(20, 8), 4), (_request(30, 0), 16)])
    assert (two.prefill_tokens, two.num_prefill_sequences) == (20, 2)
    # A shape given without rows (the planner's single-chunk what-ifs) has one if it prefills.
    assert StepShape(prefill_tokens=64).num_prefill_sequences == 1
    assert StepShape(decode_requests=8).num_prefill_sequences == 0


def test_roofline_knee():
    # 10 ms fixed, 1 ms per token past 64 tokens.
    model = StepCostModel([0.01, 0, 0, 0.001, 0, 0, 0], knee_tokens=64)
    assert model.predict(StepShape(prefill_tokens=64)) == pytest.approx(0.01)
    assert model.predict(StepShape(prefill_tokens=100)) == pytest.approx(0.046)
    assert model.predict(StepShape()) == 0.0


@pytest.mark.parametrize("knee", [math.inf, 48.0])
@pytest.mark.parametrize(
    "shape",
    [
        StepShape(decode_requests=3, decode_context_tokens=900),  # a decode step
        StepShape(decode_requests=60, decode_context_tokens=9000),  # past a finite knee
        StepShape(
            prefill_tokens=40,
            decode_requests=2,
            prefill_attention_pairs=820.0,
            decode_context_tokens=300,
            prefill_sequences=2,
        ),
    ],
)
def test_predict_is_the_features_dotted_with_the_coefficients(shape, knee):
    model = StepCostModel([0.01, 2e-4, 3e-4, 5e-4, 1e-7, 2e-6, 4e-3], knee_tokens=knee)
    expected = sum(c * f for c, f in zip(model.coefficients, model.features(shape), strict=True))
    assert model.predict(shape) == expected  # the same sums in the same order: exactly equal


def test_fit_recovers_coefficients_and_knee():
    truth = StepCostModel([0.02, 1e-5, 2e-4, 3e-4, 1e-8, 1e-6, 3e-3], knee_tokens=64)
    shapes = [
        StepShape(p, d, p * p / 2 / r, d * c, r if p else 0)
        for p in (0, 16, 128, 512, 1024)
        for r in (1, 4)
        for d in (0, 1, 8, 32)
        for c in (64, 512)
        if p or d
    ]
    samples = [(s, truth.predict(s)) for s in shapes]
    fitted = fit_cost_model(samples, knee_candidates=(32, 64, 128))
    assert fitted.knee_tokens == 64
    for shape in shapes:
        assert fitted.predict(shape) == pytest.approx(truth.predict(shape), rel=1e-3)


def test_online_refit_moves_from_the_prior_towards_new_samples():
    model = StepCostModel.from_dict(
        {"coefficients": dict(zip(FEATURES, [0.01, 0, 0, 0, 0, 0, 0], strict=True))}
    )
    for _ in range(500):  # the machine got slower: steps now take 20 ms
        model.observe(StepShape(decode_requests=4), 0.02)
    model.refit()
    assert model.predict(StepShape(decode_requests=4)) == pytest.approx(0.02, rel=0.05)
    assert all(c >= 0 for c in model.coefficients)


def test_bad_coefficients_are_refused():
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        StepCostModel([0.01, -1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="expected 7"):
        StepCostModel([0.01])
    assert math.isinf(StepCostModel([0] * 7).knee_tokens)


def test_wake_cost_follows_the_measured_curve():
    model = StepCostModel([0.01, 0, 0, 0, 0, 0, 0], wake=[(0.01, 0.002), (0.1, 0.018)])
    assert model.wake_s(0.0) == 0.0  # back to back: nothing
    assert model.wake_s(0.005) == pytest.approx(0.001)  # from (0, 0) to the first point
    assert model.wake_s(0.055) == pytest.approx(0.010)
    assert model.wake_s(5.0) == model.wake_s(math.inf) == pytest.approx(0.018)  # flat past the last
    assert StepCostModel([0.01, 0, 0, 0, 0, 0, 0]).wake_s(1.0) == 0.0
    again = StepCostModel.from_dict(model.to_dict())
    assert again.wake == model.wake
    with pytest.raises(ValueError, match="wake"):
        StepCostModel([0.01, 0, 0, 0, 0, 0, 0], wake=[(0.1, 0.01), (0.01, 0.002)])


def test_constrained_rows_that_sample_are_priced_apart_from_the_fit():
    decoding, last_chunk, first_chunk = _request(10, 12, 3), _request(20, 8), _request(30, 0)
    for request in (decoding, last_chunk, first_chunk):
        request.grammar = object()  # a structured-output matcher (engine/grammar.py)
    shape = StepShape.of([(decoding, 1), (last_chunk, 12), (first_chunk, 16)])
    assert shape.grammar_rows == 2  # the first chunk of 16 of 30 samples nothing
    model = StepCostModel([0.01, 1e-4, 2e-4, 0, 0, 0, 0])
    plain = StepShape.of([(_request(10, 12, 3), 1), (_request(20, 8), 12), (_request(30, 0), 16)])
    assert model.predict(shape) == pytest.approx(model.predict(plain) + 2 * GRAMMAR_ROW_S)
    model.observe(shape, model.predict(shape))  # the fit sees the step without the masks
    model.observe(plain, model.predict(plain))
    model.refit()
    assert model.predict(plain) == pytest.approx(0.01 + 28 * 1e-4 + 2e-4, rel=1e-3)
