"""Default targets: the stall budget derived from the seeded cost model, and the decision it
drives with no targets set — remote for a prefill that would freeze running decodes past it,
local where nothing runs (nothing to protect) or where the prefill's steps fit."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import StepCostModel
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.decision import LOCAL, REMOTE, Situation, decide
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.targets import (
    MIN_STALL_S,
    STALL_STEP_FACTOR,
    describe,
    enforced_gap_s,
    max_gap_s,
    stall_budget_on,
    unloaded_step_s,
)
from tests.sim.test_simulator import MODEL

POOL = 2


def seeded(step_s: float, token_s: float) -> OnlineCostModel:
    """A profile-seeded model of a two-core host: `step_s` a step, `token_s` a prompt token
    and 2 ms a decode on both cores; one core takes twice as long but the fixed step."""

    def on(threads: int) -> StepCostModel:
        scale = POOL / threads
        return StepCostModel([step_s, token_s * scale, 2e-3 * scale, 0, 0, 0, 0])

    profile = HardwareProfile(
        kind="measured",
        device="test",
        model=MODEL,
        size_unit="threads",
        models={1: on(1), 2: on(2)},
        transfer={},
        devices_per_node=1,
        kv_cache_bytes=1 << 24,
    )
    return OnlineCostModel(min_samples=20, profile=profile)


# A 1B model on two cores: 60 ms a decode step, a 256-token chunk ~3 s.
SLOW = seeded(0.06, 0.012)
# SmolLM2-135M's scale: 8 ms a step, a 256-token chunk ~0.3 s.
FAST = seeded(0.006, 0.001)

BESIDE_DECODES = Situation(
    num_prompt_tokens=1024,
    num_cached_decode_tokens=0,
    num_cached_prefill_tokens=0,
    pool_size=POOL,
    num_decodes=4,
    decode_context_tokens=512,
    decode_queue_tokens=0,
    decode_threads_local=POOL,
    decode_threads_split=1,
    prefill_threads=1,
    prefill_queue_tokens=0,
    prefill_parked=False,
    switch_s=0.0,
    kv_bytes_per_token=512.0,
    chunk_tokens=256,
)


def no_targets(situation: Situation, model: OnlineCostModel, **config):
    adaptive = AdaptiveConfig(enabled=True, **config)
    gap = max_gap_s(adaptive, model, situation.pool_size)
    on = stall_budget_on(adaptive)
    return decide(situation, model, None, None, adaptive.fallback_prompt_tokens, gap, on)


def test_the_stall_budget_is_ten_unloaded_steps_at_least_a_second():
    assert max_gap_s(AdaptiveConfig(), SLOW, POOL) == MIN_STALL_S  # 10 x 62 ms < 1 s
    crawling = seeded(0.2, 0.012)  # 202 ms a step: ten of them
    assert max_gap_s(AdaptiveConfig(), crawling, POOL) == pytest.approx(STALL_STEP_FACTOR * 0.202)
    assert max_gap_s(AdaptiveConfig(slo_max_gap_ms=400), SLOW, POOL) == 0.4  # the operator's
    assert max_gap_s(AdaptiveConfig(slo_max_gap_ms=0), SLOW, POOL) is None  # switched off
    assert max_gap_s(AdaptiveConfig(), OnlineCostModel(min_samples=20), POOL) is None
    with pytest.raises(ValueError, match="slo_max_gap_ms must be >= 0"):
        AdaptiveConfig(slo_max_gap_ms=-1)


def test_the_worker_holds_prefills_to_the_budget_or_its_floor_before_one_is_derived():
    # What a decode worker's stall guard is sent with each local prefill (stall_guard.py).
    crawling = seeded(0.2, 0.012)
    assert enforced_gap_s(AdaptiveConfig(), crawling, POOL) == max_gap_s(
        AdaptiveConfig(), crawling, POOL
    )
    assert enforced_gap_s(AdaptiveConfig(), OnlineCostModel(min_samples=20), POOL) == MIN_STALL_S
    assert enforced_gap_s(AdaptiveConfig(slo_max_gap_ms=2500), SLOW, POOL) == 2.5
    assert enforced_gap_s(AdaptiveConfig(slo_max_gap_ms=0), SLOW, POOL) is None


def test_a_fit_that_prices_decodes_by_their_context_alone_still_gives_an_unloaded_step():
    # Seen on SmolLM2-135M: the online fit put a decode's cost on its context (14 us a
    # token), 0 s on the step and the request; one decode attending nothing costs 0.
    model = OnlineCostModel(min_samples=20)
    rows = [[0, n, 0, n * ctx, 0, POOL, n * ctx * 1.4e-5] for n in (1, 2, 4) for ctx in (256, 2048)]
    model.observe_steps("decode", rows * 4)
    model.refit()
    assert unloaded_step_s(model, POOL) == pytest.approx(1024 * 1.4e-5, rel=1e-3)
    assert max_gap_s(AdaptiveConfig(), model, POOL) == MIN_STALL_S


def test_with_no_targets_a_prefill_that_would_freeze_running_decodes_goes_remote():
    d = no_targets(BESIDE_DECODES, SLOW)
    assert (d.kind, d.reason) == (REMOTE, "stall_budget"), d.predictions
    p = d.predictions
    assert p["stall_budget_s"] == MIN_STALL_S and p["itl_local_s"] > 3.0  # a 3 s freeze
    assert p["itl_remote_s"] < 0.75 * MIN_STALL_S  # the decodes on their one core


def test_with_nothing_running_or_steps_that_fit_the_prefill_stays_local():
    idle = dataclasses.replace(BESIDE_DECODES, num_decodes=0)
    assert no_targets(idle, SLOW).reason == "idle_decode"
    # a held split leaves the idle decode worker one core: still no stream to stall
    held = no_targets(dataclasses.replace(idle, decode_threads_local=1), SLOW)
    assert (held.kind, held.reason) == (LOCAL, "fits_slo")
    # the default model's chunks fit the second: collocated's behaviour
    fast = no_targets(BESIDE_DECODES, FAST)
    assert (fast.kind, fast.reason) == (LOCAL, "fits_slo")
    # the operator's budget wins: 5 s holds a 3 s step, 0 switches the budget off
    assert no_targets(BESIDE_DECODES, SLOW, slo_max_gap_ms=5000).kind == LOCAL
    assert no_targets(BESIDE_DECODES, SLOW, slo_max_gap_ms=0).reason == "fits_slo"


def test_before_the_model_is_usable_long_prompts_stay_off_running_decodes():
    # A fresh deployment's first steps: no derived budget yet, but one is on, so the
    # prompt-length fallback decides while decodes run (over 256 uncached tokens: remote).
    empty = OnlineCostModel(min_samples=20)
    d = no_targets(BESIDE_DECODES, empty)
    assert (d.kind, d.reason) == (REMOTE, "fallback_long")
    short = dataclasses.replace(BESIDE_DECODES, num_prompt_tokens=200)
    assert no_targets(short, empty).reason == "fallback_short"
    # nothing decoding (on the decode worker's share of a held split), or the budget off
    held = dataclasses.replace(BESIDE_DECODES, num_decodes=0, decode_threads_local=1)
    assert no_targets(held, empty).reason == "no_itl_slo"
    assert no_targets(BESIDE_DECODES, empty, slo_max_gap_ms=0).reason == "no_itl_slo"


def test_status_says_which_targets_are_set_and_what_the_derived_one_read():
    derived = describe(AdaptiveConfig(enabled=True), SLOW, [(0, 1)])
    assert derived["ttft_ms"] is None and derived["ttft_source"].startswith("per request")
    assert (derived["itl_ms"], derived["itl_source"]) == (None, "none")
    assert derived["max_gap_source"].startswith("derived")
    (pool,) = derived["pools"]
    assert pool["cpus"] == [0, 1] and pool["max_gap_ms"] == 1000.0
    assert pool["unloaded_step_ms"] == pytest.approx(62.0)
    assert pool["prefill_tokens_per_s"] == pytest.approx(512 / (0.06 + 512 * 0.012), rel=1e-3)
    given = describe(AdaptiveConfig(slo_itl_ms=60, slo_max_gap_ms=400), SLOW, [(0, 1)])
    assert given["itl_source"] == given["max_gap_source"] == "set"
    assert given["pools"][0]["max_gap_ms"] == 400.0
    unfitted = describe(AdaptiveConfig(), OnlineCostModel(min_samples=20), [(0, 1)])
    assert unfitted["pools"][0]["max_gap_ms"] is None
