"""The online cost model: fitted from StepReport rows, the documented fallback chain, the
transfer fit, and one model class with the simulator (issue 15)."""

from __future__ import annotations

import typing

import pytest

from pdserve.costmodel.profile import HardwareProfile, ModelShape
from pdserve.costmodel.step_cost import (
    ServedCostModel,
    ServedSteps,
    StepCostModel,
    StepShape,
    TransferModel,
)
from pdserve.planner.model import OnlineCostModel
from pdserve.sim.worker import SimWorker
from tests.planner.conftest import rows, truth

SHAPES = [
    StepShape(512, 0, 512 * 256.5, 0),
    StepShape(0, 16, 0, 8000),
    StepShape(128, 8, 9000, 3000),
]


def test_fit_from_step_reports_recovers_the_machine():
    model = OnlineCostModel(min_samples=20)
    assert model.observe_steps("decode", rows(4, 200)) == 200
    model.refit()
    for shape in SHAPES:
        assert model.step_s("decode", 4, shape) == pytest.approx(truth(4).predict(shape), rel=1e-3)


def test_not_usable_before_min_samples_then_usable():
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("prefill", rows(2, 19))
    model.refit()
    assert model.step_s("prefill", 2, SHAPES[0]) is None and not model.ready()
    model.observe_steps("prefill", rows(2, 1, seed=9))
    model.refit()
    assert model.step_s("prefill", 2, SHAPES[0]) == pytest.approx(
        truth(2).predict(SHAPES[0]), rel=1e-3
    )


def test_fallback_chain_other_role_then_nearest_threads_scaled():
    model = OnlineCostModel(min_samples=10)
    model.observe_steps("decode", rows(4, 100))
    model.refit()
    shape = SHAPES[2]
    # (prefill, 4) has no samples: the decode fit at 4 threads answers
    assert model.step_s("prefill", 4, shape) == model.step_s("decode", 4, shape)
    # 2 threads: none at all; the nearest (4) scaled by 4 / 2
    assert model.step_s("decode", 2, shape) == pytest.approx(2 * model.step_s("decode", 4, shape))


def test_bad_rows_are_skipped():
    model = OnlineCostModel(min_samples=1)
    good = rows(4, 1)[0]
    assert (
        model.observe_steps("decode", [[1, 2, 3], [0, 0, 0, 0, 0, 4, 0.1], [*good[:6], 0.0], good])
        == 1
    )


def test_profile_seeds_a_usable_model():
    seeded = truth(8)
    profile = HardwareProfile(
        "measured",
        "cpu: test",
        ModelShape("m", 2, 64, 128, 4, 2, 16, 100),
        "threads",
        {8: seeded},
        {"shm": TransferModel(2e9, 1e-4)},
        1,
        kv_cache_bytes=1e6,
    )
    model = OnlineCostModel(min_samples=50, profile=profile)
    assert model.step_s("prefill", 8, SHAPES[0]) == pytest.approx(seeded.predict(SHAPES[0]))
    assert model.transfer_s(2e6) == pytest.approx(1e-4 + 1e-3)


def test_transfer_fit_from_exposed_times():
    model = OnlineCostModel(min_samples=1)
    assert model.transfer_s(1e6) == 0.0  # before any sample: layer-wise sends hide it
    for num_bytes in (1e5, 1e6, 4e6, 8e6):
        model.observe_transfer(num_bytes, 2e-3 + num_bytes / 1e9)
    model.refit()
    assert model.transfer.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert model.transfer_s(2e6) == pytest.approx(2e-3 + 2e-3, rel=1e-6)


def test_planner_and_simulator_use_one_cost_model_class():
    """Issue 15: the adaptive planner and the simulator use this one model: the simulator's
    workers step with a StepCostModel (or the profile's served lines over that very one),
    and the planner's fits are StepCostModels seeded from the very profile the simulator
    reads."""
    profile = HardwareProfile(
        "measured",
        "cpu: test",
        ModelShape("m", 2, 64, 128, 4, 2, 16, 100),
        "threads",
        {4: truth(4)},
        {"shm": TransferModel(2e9)},
        1,
        kv_cache_bytes=1e6,
    )
    hint = typing.get_type_hints(SimWorker.__init__)["cost_model"]
    assert hint == StepCostModel | ServedCostModel
    profile.served_steps = {4: ServedSteps(prefill_s=0.01, decode_factor=1.1)}
    assert profile.served_cost_model(4).model is profile.cost_model(4)  # wraps, not replaces
    profile.served_steps = {}
    model = OnlineCostModel(min_samples=1, profile=profile)
    model.observe_steps("decode", rows(2, 30))
    assert {type(f.model) for f in model._fits.values()} == {StepCostModel}
    shape = SHAPES[2]
    assert model.step_s("decode", 4, shape) == profile.cost_model(4).predict(shape)


def test_a_model_never_shown_a_feature_does_not_price_it():
    """Decode-only steps leave the prefill coefficients at 0: such a model must not say a
    prefill is free; the prefill worker's model (which saw prefills) answers instead."""
    decode_only = [r for r in rows(4, 400) if r[0] == 0]
    prefill_only = [
        [n, 0, n * (n + 1) / 2, 0, 1, 4, truth(4).predict(StepShape(n, 0, n * (n + 1) / 2, 0))]
        for n in range(16, 528, 16)
    ]
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("decode", decode_only)
    model.refit()
    chunk = StepShape(512, 0, 512 * 256.5, 0)
    assert model.step_s("decode", 4, StepShape(0, 8, 0, 4000)) is not None
    assert model.step_s("decode", 4, chunk) is None
    model.observe_steps("prefill", prefill_only)
    model.refit()
    assert model.step_s("decode", 4, chunk) == pytest.approx(truth(4).predict(chunk), rel=1e-3)
    mixed = StepShape(512, 8, 512 * 256.5, 4000)
    assert model.step_s("decode", 4, mixed) is None  # neither saw both


def test_the_link_the_workers_measure_replaces_the_profiles_and_hides_behind_the_prefill():
    profile = HardwareProfile(
        "measured",
        "cpu: test",
        ModelShape("m", 2, 64, 128, 4, 2, 16, 100),
        "threads",
        {8: truth(8)},
        {"tcp": TransferModel(1e9, 1e-3)},
        1,
        kv_cache_bytes=1e6,
    )
    model = OnlineCostModel(min_samples=50, profile=profile)
    assert model.transfer is None  # the profile's figures are the link's, not exposed times
    assert model.transfer_s(1e8) == pytest.approx(1e-3 + 0.1)  # nothing to hide behind
    assert model.transfer_s(1e8, overlap_s=0.06) == pytest.approx(1e-3 + 0.04)
    assert model.transfer_s(1e8, overlap_s=1.0) == pytest.approx(1e-3)  # all hidden
    # a prefill worker's sends at 10 MB/s: 8 MB a report (under MIN_LINK_BYTES alone)
    for i in range(1, 3):
        model.observe_link("prefill-0", i * 8e6, i * 0.8)
    model.observe_link("prefill-0", 8e6, 0.8)  # restarted: its totals start again
    model.refit()
    assert model.link.bandwidth_bytes_per_s == pytest.approx(1e7)
    assert model.link.latency_s == 1e-3  # the profile's: sends measure no round trip
    assert model.transfer_s(1e8, overlap_s=1.0) == pytest.approx(1e-3 + 9.0)
    assert model.state()["link"]["num_samples"] == 3
