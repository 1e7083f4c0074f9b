"""The online cost model: fitted from StepReport rows, the documented fallback chain, the
transfer fit, and one model class with the simulator (issue 15)."""

from __future__ import annotations

import random
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


def test_fallback_chain_both_roles_then_nearest_threads_scaled():
    model = OnlineCostModel(min_samples=10)
    model.observe_steps("decode", rows(4, 100))
    model.refit()
    shape = SHAPES[2]
    # (prefill, 4) has no samples: the fit of both roles' steps at 4 threads answers
    assert model.step_s("prefill", 4, shape) == pytest.approx(model.step_s("decode", 4, shape))
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
    prefill is free; the prefill worker's steps, fitted with the decode worker's, answer
    instead, and together they price a prompt beside decodes, which neither alone ran."""
    decode_only = [r for r in rows(4, 400) if r[0] == 0]
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("decode", decode_only)
    model.refit()
    chunk = StepShape(512, 0, 512 * 256.5, 0)
    assert model.step_s("decode", 4, StepShape(0, 8, 0, 4000)) is not None
    assert model.step_s("decode", 4, chunk) is None
    model.observe_steps("prefill", _prompts(4, range(16, 528, 16)))
    model.refit()
    assert model.step_s("decode", 4, chunk) == pytest.approx(truth(4).predict(chunk), rel=1e-3)
    mixed = StepShape(512, 8, 512 * 256.5, 4000)
    assert model.step_s("decode", 4, mixed) == pytest.approx(truth(4).predict(mixed), rel=1e-3)


def test_a_model_prices_only_the_prompts_its_samples_span():
    """A decode worker whose only prompt was 98 tokens (its first step) fitted that step's
    time onto whichever prompt features it liked: it priced a 2,000-token prompt at 365 s
    on a 1B model. A fit prices prompts of up to PREFILL_RANGE times the tokens of the
    longest it ran (and its square times the attention pairs)."""
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("decode", [r for r in rows(2, 60) if r[0] == 0])
    model.observe_steps("decode", _prompts(2, [64, 80, 90, 98]))
    model.refit()
    short, long = StepShape(98, 0, 98 * 99 / 2, 0), StepShape(2000, 0, 2000 * 2001 / 2, 0)
    assert model.step_s("decode", 2, short) == pytest.approx(truth(2).predict(short), rel=1e-3)
    assert model.step_s("decode", 2, StepShape(196, 0, 196 * 197 / 2, 0)) is not None
    assert model.step_s("decode", 2, StepShape(197, 0, 0, 0)) is None  # past 2x the tokens
    assert model.step_s("decode", 2, StepShape(150, 0, 5 * 98 * 99 / 2, 0)) is None  # pairs
    assert model.step_s("decode", 2, long) is None


def test_small_chunks_beside_decodes_do_not_price_a_full_chunk():
    """Chunks of 10-16 tokens beside decodes barely vary in tokens, so a noisy fit can put
    their cost on the prefill row and price a 512-token chunk at a fraction of its time.
    Such a fit does not answer for it; the prefill worker's prompts, fitted beside the
    decode worker's steps, do."""
    rng = random.Random(3)
    true, noisy = truth(1), []
    for _ in range(80):
        n, b = rng.choice([0, rng.randint(10, 16)]), rng.randint(4, 16)
        shape = StepShape(n, b, n * (300 + (n + 1) / 2), b * 300, 1 if n else 0)
        noisy.append([*_row(shape, 1)[:6], true.predict(shape) * rng.uniform(0.85, 1.15)])
    model = OnlineCostModel(min_samples=20)
    model.observe_steps("decode", noisy)
    model.refit()
    full = StepShape(512, 8, 512 * (300 + 256.5), 8 * 300)
    assert model.step_s("decode", 1, full) is None
    model.observe_steps("prefill", _prompts(1, range(64, 1024, 32)))
    model.refit()
    assert model.step_s("decode", 1, full) == pytest.approx(true.predict(full), rel=0.2)


def _row(shape: StepShape, threads: int) -> list[float]:
    """A StepReport row of `shape` at its true time."""
    fields = [shape.prefill_tokens, shape.decode_requests, shape.prefill_attention_pairs]
    fields += [shape.decode_context_tokens, shape.num_prefill_sequences]
    return [*fields, threads, truth(threads).predict(shape)]


def _prompts(threads: int, lengths) -> list[list[float]]:
    """Prefill-only rows: one prompt of each length, from nothing cached."""
    return [_row(StepShape(n, 0, n * (n + 1) / 2, 0), threads) for n in lengths]


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
