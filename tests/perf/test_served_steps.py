"""Served steps against the model (perf/served_steps.py): the line through a phase's steps,
what each step is cleared of first, and how the profile's simulator prices served workers
with the lines (the measurement itself runs in tests/perf/test_measure.py's profile)."""

import json

import pytest

from pdserve.costmodel.analytic import MODELS, analytic_profile
from pdserve.costmodel.profile import load_profile
from pdserve.costmodel.step_cost import (
    FEATURES,
    ServedCostModel,
    ServedSteps,
    StepCostModel,
    StepShape,
)
from pdserve.perf.served_steps import fit_line, fit_served_steps, request_s

PREFILL, DECODE = StepShape(prefill_tokens=100), StepShape(decode_requests=2)


def linear_model(step_s=0.01, per_token_s=0.001, wake=()) -> StepCostModel:
    coefficients = [0.0] * len(FEATURES)
    coefficients[0], coefficients[1], coefficients[2] = step_s, per_token_s, per_token_s
    return StepCostModel(coefficients, wake=list(wake))


def test_a_line_through_steps_of_many_lengths():
    # 50 ms more than the model and 3% slower, at 0.1-2 s predicted: the line, not a ratio
    points = [(p, 0.05 + 1.03 * p) for p in (0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 1.6, 2.0)]
    assert fit_line(points) == pytest.approx((0.05, 1.03))
    # a step the client preempted (3x) moves the halves' medians a little, not the line
    extra_s, factor = fit_line([*points, (0.25, 0.9)])
    assert extra_s == pytest.approx(0.05, abs=0.04) and factor == pytest.approx(1.03, rel=0.03)


def test_steps_of_one_length_give_a_factor_alone():
    # decode steps at batch 1-4 lie within 2x of each other: a slope there is noise
    points = [(0.030, 0.033), (0.032, 0.036), (0.040, 0.044), (0.045, 0.049), (0.044, 0.047)]
    extra_s, factor = fit_line(points)
    assert extra_s == 0.0 and factor == pytest.approx(1.1, abs=0.01)


def test_a_line_that_would_need_a_negative_part_gives_a_factor_alone():
    points = [(p, 1.2 * p - 0.02) for p in (0.1, 0.2, 0.4, 0.8, 1.6)]  # crosses 0 above 0
    extra_s, factor = fit_line(points)
    assert extra_s == 0.0 and factor == pytest.approx(1.2 - 0.02 / 0.4, rel=1e-6)
    assert fit_line(points[:3]) == (0.0, 1.0)  # too few steps: the model as it is


def test_steps_the_simulators_additions_cover_keep_the_model():
    # 0.5 ms decode steps less 1 ms of token CPU each: cleared, most are below 0
    points = [
        (0.0005, 0.0006 - 0.001),
        (0.0005, 0.0004 - 0.001),
        (0.0006, 0.0007 - 0.001),
        (0.0004, 0.0005 - 0.001),
        (0.0005, 0.0020 - 0.001),
    ]
    assert fit_line(points) == (0.0, 1.0)


def test_steps_are_cleared_of_the_wake_and_the_token_cpu_the_simulator_adds():
    model = linear_model(wake=[(1.0, 0.2)])
    token_cpu_s = 0.004
    # worker 0 (1 thread of 2 cores): four prefills, each after 5 s idle (the wake: +0.2 s),
    # each followed by decodes back to back
    w0, t = [], 10.0
    for _ in range(4):
        w0.append((PREFILL, 1, t, 0.2 + 1.3 * model.predict(PREFILL)))
        t += w0[-1][3]
        for _ in range(3):
            w0.append((DECODE, 1, t, 1.1 * model.predict(DECODE)))
            t += w0[-1][3]
        t += 5.0
    # worker 1 steps through worker 0's second burst: those decodes start with both cores
    # busy, and took the router's and the client's CPU for their 2 tokens as well
    first = w0[4][2]
    w1 = [(DECODE, 1, first + i * 0.02, 0.02) for i in range(40)]
    busy_until = w1[-1][2] + 0.02
    w0 = [
        (
            sh,
            th,
            st,
            d + (2 * token_cpu_s if not sh.prefill_tokens and first < st < busy_until else 0.0),
        )
        for sh, th, st, d in w0
    ]
    assert sum(first < st < busy_until for _, _, st, _ in w0) == 3
    steps = fit_served_steps(model, [w0, w1], 2, token_cpu_s)
    assert steps.prefill_s == 0.0 and steps.prefill_factor == pytest.approx(1.3)
    # worker 1's own decodes (factor ~1.8 over the model) count too: the median keeps 1.1
    assert steps.decode_factor == pytest.approx(1.1)
    # steps before `since` (the warm-up requests') are left out: one prefill left, too few
    late = fit_served_steps(model, [w0, w1], 2, token_cpu_s, since=w0[-4][2])
    assert (late.prefill_s, late.prefill_factor) == (0.0, 1.0)


def test_the_simulator_prices_served_workers_with_the_lines():
    model = linear_model()
    steps = ServedSteps(prefill_s=0.05, prefill_factor=1.2, decode_factor=1.1)
    served = ServedCostModel(model, steps)
    assert served.predict(PREFILL) == pytest.approx(0.05 + 1.2 * model.predict(PREFILL))
    assert served.predict(DECODE) == pytest.approx(1.1 * model.predict(DECODE))
    mixed = StepShape(prefill_tokens=10, decode_requests=2)  # a prefill step: its line
    assert served.predict(mixed) == pytest.approx(0.05 + 1.2 * model.predict(mixed))
    assert served.predict(StepShape()) == 0.0

    profile = analytic_profile(MODELS["llama-3-8b"], "H100-SXM")
    profile.served_steps = {1: steps}
    assert isinstance(profile.served_cost_model(1), ServedCostModel)
    # a prefill worker steps as the engine it keeps the weights of; a size without lines too
    assert profile.served_cost_model(1, "prefill") is profile.cost_model(1)
    assert profile.served_cost_model(2) is profile.cost_model(2)


def test_served_steps_round_trip_and_rescale(tmp_path):
    from pdserve.perf.rescale import rescaled

    profile = analytic_profile(MODELS["llama-3-8b"], "H100-SXM")
    profile.served_steps = {1: ServedSteps(0.05, 1.2, 0.002, 1.1)}
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").served_steps == profile.served_steps
    out = rescaled(profile, {size: 2.0 for size in profile.models})
    assert out.served_steps[1] == ServedSteps(0.1, 1.2, 0.004, 1.1)  # seconds, not factors
    data = json.loads((tmp_path / "p.json").read_text())
    data["served_steps"]["1"]["prefill_factor"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"served_steps.prefill_factor must be > 0"):
        load_profile(tmp_path / "bad.json")


def test_the_load_is_sized_from_the_model():
    model = linear_model()
    # a 256-token prefill and 48 decode steps at batch 1
    assert request_s(model) == pytest.approx(0.01 + 0.256 + 48 * 0.011)
