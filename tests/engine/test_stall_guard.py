"""The worker's stall guard: measured step times to a prefill cap within a stall budget."""

from pdserve.engine.stall_guard import (
    HEADROOM,
    MIN_CHUNK_TOKENS,
    PROBE_TOKENS,
    StallGuard,
)


def test_before_any_prefill_is_measured_the_cap_is_a_probe_chunk():
    guard = StallGuard()
    assert guard.cap(1.0) == PROBE_TOKENS
    guard.observe(1, 0, 4, 0.05)  # decodes alone say nothing of a prompt token
    assert guard.cap(1.0) == PROBE_TOKENS
    guard.observe(1, 8, 4, 0.5)  # too few tokens to price one
    assert guard.cap(1.0) == PROBE_TOKENS


def test_the_cap_is_what_fits_the_budget_beside_the_decode_step():
    guard = StallGuard()
    guard.observe(1, 0, 4, 0.05)
    guard.observe(1, 100, 4, 1.05)  # 10 ms a prompt token beside the decodes
    assert guard.cap(1.0) == int((HEADROOM * 1.0 - 0.05) / 0.01)  # 70
    assert guard.cap(2.0) == int((HEADROOM * 2.0 - 0.05) / 0.01)  # 145
    # a decode step alone over the budget still lets the prompt progress
    assert guard.cap(0.04) == MIN_CHUNK_TOKENS


def test_a_prefill_alone_charges_the_whole_step_to_its_tokens():
    guard = StallGuard()
    guard.threads = 2
    guard.observe(2, 0, 3, 0.1)
    guard.observe(2, 200, 0, 1.0)  # 5 ms a token, the step's fixed cost included
    assert guard.cap(1.0) == int((0.75 - 0.1) / 0.005)


def test_the_averages_follow_a_host_that_slows_down():
    guard = StallGuard()
    guard.observe(1, 0, 1, 0.0)
    guard.observe(1, 100, 0, 0.5)
    before = guard.cap(1.0)
    guard.observe(1, 100, 0, 1.5)  # other work took the core: three times slower
    after = guard.cap(1.0)
    assert after < before / 1.9  # half of the newest step's weight at once
    for _ in range(8):
        guard.observe(1, 100, 0, 1.5)
    assert guard.cap(1.0) == int(0.75 / 0.015)


def test_a_thread_count_not_seen_yet_is_priced_from_the_nearest_scaled():
    # A core switch applies between steps: the first step on one thread must not be priced
    # at two threads' speed (a mispriced 219-token prompt froze the streams for 1.68 s).
    guard = StallGuard()
    guard.threads = 2
    guard.observe(2, 0, 2, 0.02)
    guard.observe(2, 100, 2, 0.52)  # 5 ms a token on two threads
    on_two = guard.cap(1.0)
    guard.threads = 1
    assert guard.cap(1.0) == int((0.75 - 0.04) / 0.01)  # twice the time on one thread
    assert guard.cap(1.0) < on_two / 1.9
    guard.observe(1, 100, 2, 0.04 + 1.2)  # then its own steps decide
    assert guard.cap(1.0) == int((0.75 - 0.04) / 0.012)
