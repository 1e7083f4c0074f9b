"""This machine's name, the same-machine check a profile passes before it is rescaled or
updated, and the two KV transfer bandwidths `pdserve profile` measures."""

import os

import pytest

from pdserve.costmodel.analytic import analytic_profile, model_shape
from pdserve.costmodel.profile import HardwareProfile
from pdserve.perf.machine import check_same_machine, cpu_name, shm_bandwidth, tcp_bandwidth


def measured_here(**machine) -> HardwareProfile:
    profile = analytic_profile(model_shape("llama-3-8b"), "H100-SXM").to_dict()
    here = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))}
    profile.update(kind="measured", size_unit="threads", machine=here | machine)
    return HardwareProfile.from_dict(profile)


def test_a_profile_of_this_cpu_and_core_count_passes():
    assert cpu_name()  # /proc/cpuinfo's model name, or platform's
    check_same_machine(measured_here())


@pytest.mark.parametrize(
    ("machine", "message"),
    [
        ({"cpu": "another cpu"}, "measured on 'another cpu' with"),
        ({"cores": 999}, "with 999 cores, this is"),
    ],
)
def test_a_profile_of_another_cpu_or_core_count_is_refused(machine, message):
    with pytest.raises(ValueError, match=message):
        check_same_machine(measured_here(**machine))


def test_an_analytic_profile_is_refused():
    with pytest.raises(ValueError, match="only a measured CPU profile"):
        check_same_machine(analytic_profile(model_shape("llama-3-8b"), "H200"))


def test_bandwidths_are_measured_and_positive():
    tcp, shm = tcp_bandwidth(8 * 2**20), shm_bandwidth(8 * 2**20)
    assert tcp.bandwidth_bytes_per_s > 1e6 and 0 < tcp.latency_s < 1
    assert shm.bandwidth_bytes_per_s > 1e6 and shm.latency_s == 0.0
