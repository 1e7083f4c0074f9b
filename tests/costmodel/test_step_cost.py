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


@pytest.mark.parametrize("rows", [math.inf, 16.0])
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
def test_predict_is_the_features_dotted_with_the_coefficients(shape, knee, rows):
    coefficients = [0.01, 2e-4, 3e-4, 5e-4, 1e-7, 2e-6, 4e-3, 1e-4]
    model = StepCostModel(coefficients, knee_tokens=knee, row_kernel_rows=rows)
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


def test_rows_are_priced_by_the_kernels_that_run_them():
    # 10 ms a step; a row 5 ms in row kernels, 1 ms in tiles after 200 ms converting the weights
    model = StepCostModel([0.01, 1e-3, 5e-3, 0, 0, 0, 0, 0.2], row_kernel_rows=16)
    assert model.predict(StepShape(decode_requests=16)) == pytest.approx(0.01 + 16 * 5e-3)
    assert model.predict(StepShape(decode_requests=17)) == pytest.approx(0.21 + 17 * 1e-3)
    # a step's linears run its rows together: a prompt token beside 3 decodes in row kernels,
    # 8 decodes beside a 12-token chunk in tiles
    assert model.predict(StepShape(prefill_tokens=1, decode_requests=3)) == pytest.approx(0.03)
    mixed = StepShape(prefill_tokens=12, decode_requests=8)
    assert model.predict(mixed) == pytest.approx(0.21 + 20 * 1e-3)
    again = StepCostModel.from_dict(model.to_dict())
    assert again.row_kernel_rows == 16 and again.coefficients == model.coefficients
    assert model.scaled(2.0).predict(mixed) == pytest.approx(2 * model.predict(mixed))
    # one regime: prompt tokens and decodes by their own terms, no tiled step
    one = StepCostModel([0.01, 1e-3, 5e-3, 0, 0, 0, 0])
    assert one.predict(mixed) == pytest.approx(0.01 + 12 * 1e-3 + 8 * 5e-3)


# Decode steps of a 1B Q4_K_M model (Llama 3.2 1B shape, random weights) on one thread of
# the 2-core Xeon VM (AVX-512 + AMX), 64-token prompts: batch -> (context tokens, seconds),
# each the median step of its batch. Row kernels up to 16 rows, AMX tiles above
# (quant_linear.gemv_m_max): 16 rows took what 32 did.
MEASURED_1B_DECODE = {
    1: (66, 0.0595),
    2: (138, 0.0652),
    4: (276, 0.09),
    8: (544, 0.1746),
    12: (780, 0.36),
    16: (1104, 0.3826),
    17: (1207, 0.3835),
    20: (1360, 0.3399),
    24: (1704, 0.3492),
    32: (2272, 0.3545),
}


def test_two_kernel_regimes_fit_measured_1b_steps_that_one_decode_term_misprices():
    samples = {
        b: (StepShape(decode_requests=b, decode_context_tokens=c), s)
        for b, (c, s) in MEASURED_1B_DECODE.items()
    }

    def error(model, batch):
        shape, seconds = samples[batch]
        return abs(model.predict(shape) / seconds - 1)

    split = fit_cost_model(list(samples.values()), row_kernel_rows=16)
    one = fit_cost_model(list(samples.values()))
    assert split.row_kernel_rows == 16 and math.isinf(one.row_kernel_rows)
    assert error(one, 16) > 0.25 and error(one, 32) > 0.25
    assert all(error(split, b) < 0.10 for b in (16, 17, 20, 24, 32))


def test_fit_keeps_one_regime_without_decode_steps_in_tiles():
    samples = [(StepShape(decode_requests=b), 0.01 + 5e-3 * b) for b in (1, 4, 8, 16)]
    samples.append((StepShape(prefill_tokens=64), 0.2))
    fitted = fit_cost_model(samples, row_kernel_rows=16)
    assert math.isinf(fitted.row_kernel_rows)  # its tiled step and c_sequence: one column
    assert fitted.predict(StepShape(decode_requests=32)) == pytest.approx(0.17, rel=1e-3)


def test_a_model_of_one_regime_reads_as_it_was_fitted():
    # a cost model written without the split: prompt tokens and decodes by their own terms
    data = {"coefficients": dict(zip(FEATURES[:7], [0.01, 1e-3, 5e-3, 0, 0, 0, 0], strict=True))}
    model = StepCostModel.from_dict(data)
    assert math.isinf(model.row_kernel_rows) and model.coefficients[7] == 0
    assert model.predict(StepShape(32, 8)) == pytest.approx(0.01 + 32 * 1e-3 + 8 * 5e-3)
    with pytest.raises(ValueError, match="tiled_step"):
        StepCostModel.from_dict(data | {"row_kernel_rows": 16})


def test_online_refit_moves_from_the_prior_towards_new_samples():
    model = StepCostModel.from_dict(
        {"coefficients": dict(zip(FEATURES, [0.01, 0, 0, 0, 0, 0, 0, 0], strict=True))}
    )
    for _ in range(500):  # the machine got slower: steps now take 20 ms
        model.observe(StepShape(decode_requests=4), 0.02)
    model.refit()
    assert model.predict(StepShape(decode_requests=4)) == pytest.approx(0.02, rel=0.05)
    assert all(c >= 0 for c in model.coefficients)


def test_bad_coefficients_are_refused():
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        StepCostModel([0.01, -1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="expected 8"):
        StepCostModel([0.01])
    with pytest.raises(ValueError, match="expected 8"):  # two regimes need the tiled term
        StepCostModel([0.01, 0, 0, 0, 0, 0, 0], row_kernel_rows=16)
    with pytest.raises(ValueError, match="row_kernel_rows"):
        StepCostModel([0.01] * 8, row_kernel_rows=-1)
    assert math.isinf(StepCostModel([0] * 8).knee_tokens)
    # one regime: seven terms, no tiled step
    assert StepCostModel([0, 0, 2e-3, 0, 0, 0, 0]).coefficients[7] == 0


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
