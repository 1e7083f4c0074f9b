"""The worker's stall guard: measured step times to a prefill cap within a stall budget."""

import pytest

from pdserve.engine.stall_guard import (
    DEVIATIONS,
    HEADROOM,
    LEAST_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS,
    PROBE_TOKENS,
    StallGuard,
)


def steady(guard: StallGuard, threads: int, decode_s: float, token_s: float, n: int = 40):
    """Steps of one shape, the same time each: the deviation fades."""
    for _ in range(n):
        guard.observe(threads, 0, 4, decode_s)
        guard.observe(threads, 100, 4, decode_s + 100 * token_s)


def test_before_any_prefill_is_measured_the_cap_is_a_probe_chunk():
    guard = StallGuard()
    assert guard.cap(1.0, 4) == PROBE_TOKENS
    guard.observe(1, 0, 4, 0.05)  # decodes alone say nothing of a prompt token
    assert guard.cap(1.0, 4) == PROBE_TOKENS
    guard.observe(1, 8, 4, 0.5)  # too few tokens to price one
    assert guard.cap(1.0, 4) == PROBE_TOKENS


def test_the_cap_is_what_fits_the_budget_beside_the_decode_step():
    guard = StallGuard()
    guard.observe(1, 0, 4, 0.05)
    guard.observe(1, 100, 4, 1.05)  # 10 ms a prompt token beside the decodes
    # one sample: half of it as its deviation (RFC 6298), so twice the time a token
    assert guard.cap(1.0, 4) == int((HEADROOM - 0.05) / (0.01 * (1 + DEVIATIONS / 2)))
    steady(guard, 1, 0.05, 0.01)
    assert guard.cap(1.0, 4) == pytest.approx((HEADROOM - 0.05) / 0.01, abs=1.5)  # 40
    assert guard.cap(2.0, 4) == pytest.approx((HEADROOM * 2 - 0.05) / 0.01, abs=1.5)  # 85
    # a decode step alone over the budget still lets the prompt progress
    assert guard.cap(0.04, 4) == LEAST_CHUNK_TOKENS


def test_the_least_chunk_does_not_take_a_step_past_the_whole_budget():
    # One AVX2 core, a 1B batch: the decodes alone 0.6 s, a prompt token 28 ms. Under a 1 s
    # budget their 45% leaves no room; sixteen tokens would take the step to 1.05 s.
    guard = StallGuard()
    steady(guard, 1, 0.6, 0.028)
    assert 0.6 + MIN_CHUNK_TOKENS * 0.028 > 1.0
    cap = guard.cap(1.0, 4)
    assert LEAST_CHUNK_TOKENS < cap < MIN_CHUNK_TOKENS
    assert 0.6 + cap * 0.028 <= 1.0
    # where sixteen fit the whole budget, the least chunk is sixteen (the prompt progresses)
    assert guard.cap(1.2, 4) == MIN_CHUNK_TOKENS


def test_the_decode_step_is_priced_for_the_decodes_the_step_runs():
    # One AVX2 core, a 1B model: 7 decodes step in 0.34 s, 16 in 0.8 s. A mean over both
    # (0.57 s) would leave 16 decodes room for 15 prompt tokens under a 1 s budget: 1.22 s.
    guard = StallGuard()
    for _ in range(20):
        guard.observe(1, 0, 7, 0.34)
        guard.observe(1, 0, 16, 0.8)
        guard.observe(1, 32, 7, 0.34 + 32 * 0.028)
    beside_16 = guard.cap(1.0, 16)
    assert beside_16 == 7 and 0.8 + beside_16 * 0.028 <= 1.0
    assert guard.cap(1.0, 7) == MIN_CHUNK_TOKENS  # 0.34 s leaves the whole budget 16
    # an unseen number of decodes: the nearest seen, scaled by decodes (12 -> 0.6 s)
    assert guard.cap(1.0, 12) == 14  # (1 - 0.6) / 0.028
    # decode steps that vary around their number's average shrink the chunk beside them
    for i in range(20):
        guard.observe(1, 0, 16, 0.7 if i % 2 else 0.9)
    assert 0.8 + guard.cap(1.0, 16) * 0.028 < 0.9


def test_a_prefill_alone_charges_the_whole_step_to_its_tokens():
    guard = StallGuard()
    guard.threads = 2
    for _ in range(40):
        guard.observe(2, 0, 3, 0.1)
        guard.observe(2, 200, 0, 1.0)  # 5 ms a token, the step's fixed cost included
    assert guard.cap(1.0, 3) == pytest.approx((HEADROOM - 0.1) / 0.005, abs=1.5)


def test_steps_that_vary_get_smaller_chunks_than_steady_ones():
    # Same mean (10 ms a token), one host steady, one swinging 5-15 ms from step to step.
    calm, loaded = StallGuard(), StallGuard()
    steady(calm, 1, 0.0, 0.01)
    for i in range(40):
        loaded.observe(1, 0, 4, 0.0)
        loaded.observe(1, 100, 4, 100 * (0.005 if i % 2 else 0.015))
    assert loaded.cap(1.0, 4) < 0.6 * calm.cap(1.0, 4)


def test_the_averages_follow_a_host_that_slows_down():
    guard = StallGuard()
    steady(guard, 1, 0.0, 0.005)
    before = guard.cap(1.0, 4)
    guard.observe(1, 100, 0, 1.5)  # other work took the core: three times slower
    assert guard.cap(1.0, 4) < before / 2  # the mean and its deviation grow at once
    steady(guard, 1, 0.0, 0.015)
    assert guard.cap(1.0, 4) == pytest.approx(HEADROOM / 0.015, abs=1.5)


def test_a_thread_count_not_seen_yet_is_priced_from_the_nearest_scaled():
    # A core switch applies between steps: the first step on one thread must not be priced
    # at two threads' speed (a mispriced 219-token prompt froze the streams for 1.68 s).
    guard = StallGuard()
    guard.threads = 2
    steady(guard, 2, 0.02, 0.005)  # 5 ms a token on two threads
    on_two = guard.cap(1.0, 4)
    guard.threads = 1
    assert guard.cap(1.0, 4) == pytest.approx((HEADROOM - 0.04) / 0.01, abs=1.5)  # twice the time
    assert guard.cap(1.0, 4) < on_two / 1.9
    steady(guard, 1, 0.04, 0.012)  # then its own steps decide
    assert guard.cap(1.0, 4) == pytest.approx((HEADROOM - 0.04) / 0.012, abs=1.5)


def test_the_worker_reports_its_budget_its_cap_and_the_steps_the_cap_bound():
    guard = StallGuard()
    assert guard.fields() == {
        "stall_budget_s": None,
        "stall_cap_tokens": None,
        "num_stall_capped_steps": 0,
    }
    steady(guard, 1, 0.05, 0.01)  # unbudgeted steps: nothing capped
    assert guard.num_capped_steps == 0
    cap = guard.cap(1.0, 4)  # 40 tokens
    guard.cap(2.0, 4)  # a second request in the step: the least cap is the step's
    guard.observe(1, cap, 4, 0.45)  # the step took all the cap allowed
    guard.cap(1.0, 4)
    guard.observe(1, cap - 10, 4, 0.35)  # a prompt's last, shorter chunk: not bound by it
    guard.observe(1, cap, 4, 0.45)  # no cap asked for this step
    assert guard.fields() == {
        "stall_budget_s": 1.0,
        "stall_cap_tokens": cap,
        "num_stall_capped_steps": 1,
    }
