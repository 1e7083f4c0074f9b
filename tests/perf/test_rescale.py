"""`pdserve profile --rescale`: a probe's ratio, the rescaled profile, what it refuses, and a
probe on a real engine that finds a profile four times too fast."""

import os
from dataclasses import replace

import pytest

from pdserve.costmodel.analytic import analytic_profile, model_shape
from pdserve.costmodel.profile import HardwareProfile, ServedOverhead
from pdserve.costmodel.step_cost import FEATURES, StepCostModel, StepShape, fit_cost_model
from pdserve.perf.machine import cpu_name
from pdserve.perf.measure import (
    PROBE_GRID,
    ProfileConfig,
    pinned_engine,
    time_grid,
)
from pdserve.perf.rescale import SERVED_SECONDS, probe_grid, probe_ratios, rescaled, speed_ratio

PREFILL, DECODE = StepShape(prefill_tokens=100), StepShape(decode_requests=4)


def cpu_profile(models: dict[int, StepCostModel], name: str = "m", **machine) -> HardwareProfile:
    here = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))}
    return HardwareProfile(
        kind="measured",
        device="cpu: x",
        model=model_shape("llama-3-8b"),
        size_unit="threads",
        models=models,
        transfer={},
        devices_per_node=here["cores"],
        kv_cache_bytes=1 << 20,
        machine=here | machine,
        served=ServedOverhead(request_s=0.004, token_s=0.001, token_cpu_s=0.002),
    )


def linear_model(step_s: float = 0.01, per_token_s: float = 0.001) -> StepCostModel:
    coefficients = [0.0] * len(FEATURES)
    coefficients[0], coefficients[1], coefficients[2] = step_s, per_token_s, per_token_s
    return StepCostModel(coefficients)


def test_speed_ratio_weighs_prefill_and_decode_steps_alike():
    model = linear_model()
    # one prefill twice as slow as predicted, many decodes 1.5 times: sqrt(2 * 1.5), not ~1.5
    samples = [(PREFILL, 2 * model.predict(PREFILL))]
    samples += [(DECODE, 1.5 * model.predict(DECODE))] * 20
    assert speed_ratio(model, samples) == pytest.approx(3**0.5)
    with pytest.raises(ValueError, match="prefill and decode steps"):
        speed_ratio(model, samples[1:])


def test_speed_ratio_is_over_the_profiles_own_probe_where_it_has_one():
    model = linear_model()
    # the fit priced the probe's prefills 10% high and its decodes 5% low when it was measured:
    # the same steps timed again are the same speed, not 0.9 and 1.05 times it
    samples = [(PREFILL, 0.9 * model.predict(PREFILL)), (DECODE, 1.05 * model.predict(DECODE))]
    assert speed_ratio(model, samples, {"prefill": 0.9, "decode": 1.05}) == pytest.approx(1.0)
    slower = [(s, 1.2 * t) for s, t in samples]
    assert speed_ratio(model, slower, {"prefill": 0.9, "decode": 1.05}) == pytest.approx(1.2)
    assert speed_ratio(model, slower) == pytest.approx((1.08 * 1.26) ** 0.5)  # no baseline


def test_rescaled_profile_scales_each_thread_count_and_the_served_seconds():
    profile = cpu_profile({1: linear_model(), 2: linear_model(0.02)})
    out = rescaled(profile, {1: 1.25, 2: 0.8})
    assert out.cost_model(1).predict(PREFILL) == pytest.approx(1.25 * 0.11)
    assert out.cost_model(2).predict(DECODE) == pytest.approx(0.8 * 0.024)
    for key in SERVED_SECONDS:  # seconds of one process: the one-thread ratio
        assert getattr(out.served, key) == pytest.approx(1.25 * getattr(profile.served, key))
    assert out.machine["rescaled"]["ratios"] == {"1": 1.25, "2": 0.8}
    assert (
        out.machine["cpu"] == profile.machine["cpu"] and profile.models[1].coefficients[0] == 0.01
    )
    loaded = HardwareProfile.from_dict(out.to_dict())  # a file like any other
    assert loaded.cost_model(1).coefficients == out.cost_model(1).coefficients


def test_a_probe_times_the_shapes_its_baseline_was_taken_on():
    assert probe_grid({"prefill": 1.0, "decode": 1.0, "shapes": [[80, 1], [64, 16]]}) == (
        (80, 1),
        (64, 16),
    )
    assert probe_grid(None) == PROBE_GRID  # no baseline: against the model, today's shapes


def test_rescale_refuses_another_machine_and_analytic_profiles():
    with pytest.raises(ValueError, match="measured on 'another cpu' with 2 cores"):
        probe_ratios(cpu_profile({1: linear_model()}, cpu="another cpu", cores=2))
    with pytest.raises(ValueError, match="only a measured CPU profile rescales"):
        probe_ratios(analytic_profile(model_shape("llama-3-8b"), "H100-SXM"))


@pytest.mark.slow
def test_a_probe_finds_a_profile_four_times_too_fast(tiny_served_model):
    cfg = ProfileConfig(
        str(tiny_served_model),
        (1,),
        kv_cache_bytes=1 << 20,
        decode_steps=6,
        repeats=1,
        grid=(*PROBE_GRID, (32, 4)),
    )
    with pinned_engine(cfg, 1) as engine:
        fitted = fit_cost_model(time_grid(cfg, engine))
    profile = cpu_profile({1: fitted.scaled(0.25)})
    profile = replace(profile, model=replace(profile.model, name=str(tiny_served_model)))
    ratio = probe_ratios(profile, decode_steps=6)[1]
    assert 2 < ratio < 8, ratio  # 4, give or take a noisy machine's step times
    # with the probe of the profile's time (here: one 4x faster than the fitted model's)
    # the ratio is to it: the same 4, however the fit priced the probe's shapes
    baseline = {"1": {"prefill": 0.25, "decode": 0.25, "decode_steps": 6}}
    profile = replace(profile, models={1: fitted}, machine={**profile.machine, "probe": baseline})
    ratio = probe_ratios(profile)[1]
    assert 2 < ratio < 8, ratio
