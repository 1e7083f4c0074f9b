"""The prefill worker's send cost from two prompt lengths' extra step time, and a process's
CPU time (perf/served.py; the served measurements themselves run in
tests/perf/test_measure.py's profile)."""

import os
import time

import pytest

from pdserve.perf.served import cpu_s, send_cost


def test_send_cost_is_the_line_through_the_two_lengths():
    # 8 ms at 32 tokens, 27 ms at 256: 5.3 ms per step and 84.8 us per token
    step_s, token_s = send_cost({256: 0.027, 32: 0.008})
    assert token_s == pytest.approx(0.019 / 224)
    assert step_s == pytest.approx(0.008 - 32 * 0.019 / 224)


def test_send_cost_never_goes_below_zero():
    assert send_cost({32: 0.010, 256: 0.004}) == (0.010, 0.0)  # longer, yet faster: noise
    step_s, token_s = send_cost({32: 0.001, 256: 0.05})  # steep: the line crosses 0 before 32
    assert step_s == 0.0 and token_s > 0


def test_cpu_s_counts_a_processes_cpu_not_its_sleep():
    before = cpu_s(os.getpid())
    time.sleep(0.05)
    slept = cpu_s(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:  # burn 0.1 s of CPU
        pass
    assert slept - before < 0.03 and 0.08 <= cpu_s(os.getpid()) - slept < 0.5
    assert cpu_s(2**22 + 1) == 0.0  # no such process (above the kernel's pid limit)
