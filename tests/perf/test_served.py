"""A process's CPU time (perf/served.py; the served measurements themselves run in
tests/perf/test_measure.py's profile)."""

import os
import time

from pdserve.perf.served import cpu_s


def test_cpu_s_counts_a_processes_cpu_not_its_sleep():
    before = cpu_s(os.getpid())
    time.sleep(0.05)
    slept = cpu_s(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:  # burn 0.1 s of CPU
        pass
    assert slept - before < 0.03 and 0.08 <= cpu_s(os.getpid()) - slept < 0.5
    assert cpu_s(2**22 + 1) == 0.0  # no such process (above the kernel's pid limit)
