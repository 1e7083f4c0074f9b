"""`pdserve simulate --deployment adaptive`: the planner's own decision and core groups in
the simulator. Short prompts at low load are collocated's timeline exactly; long prompts over
running decodes with a tight ITL go remote and keep the decodes' inter-token latency."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.cli import main
from pdserve.config import SchedulerConfig
from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import StepCostModel, TransferModel
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.targets import STALL_HEADROOM
from pdserve.sim.adaptive import AdaptiveSimulation
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.simulator import Simulation
from tests.planner.conftest import ONE_B, two_cores
from tests.sim.test_simulator import MODEL, sessions

POOL = 4
# 4 threads: 2 ms a step, 0.2 ms a prefill token, 0.5 ms a decode; linear speed-up but the step
CPU = HardwareProfile(
    kind="measured",
    device="test",
    model=MODEL,
    size_unit="threads",
    models={POOL: StepCostModel([2e-3, 2e-4, 5e-4, 0, 0, 0, 0])},
    transfer={"tcp": TransferModel(512e6, 1e-4)},
    devices_per_node=1,
    kv_cache_bytes=16384 * MODEL.kv_bytes_per_token,
)
CONFIG = SimConfig(scheduler=SchedulerConfig(long_prefill_token_threshold=128))


def simulate(spec: str, work, adaptive: AdaptiveConfig | None = None):
    deployment = Deployment.parse(spec, collocated_size=POOL)
    if deployment.adaptive:
        sim = AdaptiveSimulation(CPU, deployment, CONFIG, adaptive)
    else:
        sim = Simulation(CPU, deployment, CONFIG)
    records = sim.run(work, ArrivalSpec("trace")).records
    return sim, {r.request_id: r for r in records}


def test_short_prompts_at_low_load_are_collocated_exactly():
    work = sessions(*[(0.2 * i, 40 + i, 16) for i in range(10)])  # one at a time
    _, collocated = simulate("collocated", work)
    sim, adaptive = simulate("adaptive", work)
    for key, r in collocated.items():
        a = adaptive[key]
        assert [a.ttft_s, *a.itl_s, a.e2e_s] == pytest.approx([r.ttft_s, *r.itl_s, r.e2e_s])
    assert set(sim.decisions) == {("local", "idle_decode")}
    assert sim.groups.num_switches == 0  # the decode worker kept every core


def test_long_prompts_over_running_decodes_go_remote_and_keep_the_itl():
    decodes = [(0.001 * i, 32, 400) for i in range(8)]  # running for a while
    # From 0.6 s: after the 0.5 s heartbeat, whose Stats show the decodes' context.
    long_prompts = [(0.6 + 0.15 * i, 1024, 8) for i in range(6)]
    work = sessions(*decodes, *long_prompts)
    slo = AdaptiveConfig(enabled=True, slo_itl_ms=20.0)  # ~2x the unloaded decode step
    _, collocated = simulate("collocated", work)
    sim, adaptive = simulate("adaptive", work, slo)
    assert ("remote", "itl_interference") in sim.decisions
    assert sim.groups.num_switches >= 2  # split while the long prompts ran

    def p99_itl(records):
        gaps = sorted(
            g for key, r in records.items() if int(key[1:].split("-")[0]) < 8 for g in r.itl_s
        )
        return gaps[int(0.99 * len(gaps))]

    assert p99_itl(adaptive) <= 0.020 < p99_itl(collocated)
    assert len(adaptive) == len(work) and all(r.output_len for r in adaptive.values())


def test_deployment_adaptive_shares_the_collocated_size():
    d = Deployment.parse("adaptive", collocated_size=4)
    assert (d.num_prefill, d.num_decode, d.num_devices, d.adaptive) == (1, 1, 4, True)
    with pytest.raises(ValueError, match="needs >= 2"):
        Deployment.parse("adaptive")


def test_with_no_targets_running_streams_are_not_frozen_past_the_derived_stall_budget():
    # A 1B model's shape on 4 threads: 50 ms a step, a 128-token chunk 2.6 s. Collocated,
    # each chunk of the long prompts freezes the two streams for 2.6 s; the adaptive
    # deployment, told no numbers, holds them within its derived budget (1 s: 10 x 50 ms is
    # under the floor): each long prompt goes remote or in chunks the budget prices. Here a
    # prompt token takes 20 ms: on the one thread a split would leave the prefill worker,
    # 512 tokens take 41 s, so the prompts prefill beside the decodes on every core in chunks
    # the decode worker's StallGuard caps at 45% of the budget from the steps it measured.
    slow = HardwareProfile(
        kind="measured",
        device="test",
        model=MODEL,
        size_unit="threads",
        models={POOL: StepCostModel([0.05, 0.02, 5e-4, 0, 0, 0, 0])},
        transfer={"tcp": TransferModel(512e6, 1e-4)},
        devices_per_node=1,
        kv_cache_bytes=16384 * MODEL.kv_bytes_per_token,
    )
    work = sessions((0.0, 32, 300), (0.001, 32, 300), *[(1.0 + 3 * i, 512, 4) for i in range(3)])
    deployment = Deployment.parse("adaptive", collocated_size=POOL)
    sim = AdaptiveSimulation(slow, deployment, CONFIG)
    adaptive = {r.request_id: r for r in sim.run(work, ArrivalSpec("trace")).records}
    alone = Simulation(slow, Deployment.parse("collocated", collocated_size=POOL), CONFIG)
    collocated = {r.request_id: r for r in alone.run(work, ArrivalSpec("trace")).records}
    streams = ("s0-0", "s1-0")
    assert min(collocated[k].max_gap_s for k in streams) > 2.5
    assert max(adaptive[k].max_gap_s for k in streams) <= STALL_HEADROOM * 1.0, sim.decisions
    assert {kind for kind, _ in sim.decisions} == {"local"}, sim.decisions
    assert sim.groups.num_switches == 0  # the decodes kept every core
    guard = sim.summary()  # (0.45 - 0.05 s) / 20 ms a token: 20 tokens, less the deviation
    assert guard["stall_budget_s"] == 1.0 and 16 <= guard["stall_cap_tokens"] <= 20
    assert guard["num_stall_capped_steps"] >= 3 * 512 // 20
    assert all(r.output_len for r in adaptive.values()) and len(adaptive) == len(work)


def test_a_slow_link_keeps_the_long_prompts_local():
    """The long prompts that go remote over a 512 MB/s link (the test above) stay local over
    a 0.5 MB/s one: 1,024 tokens of KV (0.5 MB) take 1 s on the wire, of which their ~0.2 s
    prefill hides little, far over the ITL target; and the simulated transfers cross the link
    the planner priced (`transfer_backend`)."""
    decodes = [(0.001 * i, 32, 400) for i in range(8)]
    work = sessions(*decodes, *[(0.6 + 0.15 * i, 1024, 8) for i in range(6)])
    slo = AdaptiveConfig(enabled=True, slo_itl_ms=20.0)
    deployment = Deployment.parse("adaptive", collocated_size=POOL)
    links = {"fast": TransferModel(512e6, 1e-4), "slow": TransferModel(0.5e6, 1e-4)}
    remote = {}
    for backend in links:
        profile = dataclasses.replace(CPU, transfer=links)
        config = dataclasses.replace(CONFIG, transfer_backend=backend)
        sim = AdaptiveSimulation(profile, deployment, config, slo)
        assert len(sim.run(work, ArrivalSpec("trace")).records) == len(work)
        remote[backend] = sum(n for (kind, _), n in sim.decisions.items() if kind == "remote")
    assert remote["fast"] >= 3 and remote["slow"] == 0, remote


def test_simulate_prints_the_planners_decisions_and_the_decode_workers_stall_guard(
    tmp_path, capsys
):
    # The README's 1B cell on two cores, at the planner tests' 1B step times: no split holds
    # a batch within the stall budget, so prompts prefill beside it in guarded chunks.
    path = tmp_path / "profile.json"
    dataclasses.replace(two_cores(ONE_B), devices_per_node=2).save(path)
    argv = [
        "simulate",
        "--profile",
        str(path),
        "--deployment",
        "adaptive",
        "--input-len",
        "1024",
        "--output-len",
        "128",
        "--rate",
        "0.05",
        "--num-requests",
        "16",
        "--slo-max-gap-ms",
        "1800",
        "--no-progress",
    ]
    assert main(argv) == 0
    lines = dict(
        line.split(None, 2)[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("planner ")
    )
    assert "local/stall_split" in lines["decisions"]
    assert float(lines["stall_budget_s"]) == 1.8
    assert 16 <= int(lines["stall_cap_tokens"]) < 1024 and int(lines["num_stall_capped_steps"]) > 0


# Fitted to the README's 1B cell (Llama 3.2 1B shape, Q4_1, AMX prefill) on two cores: on two
# threads a decode 0.055 s and a prompt token 1.9 ms; on one, with the other core busy, a
# decode 0.1 s and a prompt token 4.5 ms (a burst's two 1,024-token prompts took ~9 s there).
BURST_1B = {2: [0.03, 1.9e-3, 0.025, 0, 0, 0, 0], 1: [0.0, 4.5e-3, 0.1, 0, 0, 0, 0]}


def test_a_burst_of_long_prompts_prefills_where_it_is_done_soonest():
    """Three 1,024-token prompts within 0.4 s and no targets (the derived 1 s stall budget).
    Sent remote, the second and third queued on the prefill worker's one core and prefilled
    together (here 9.8 s to both first tokens, the cell's 10.1 s); with the split's slowdown
    of the decode worker's queue priced, they prefill on its two cores in guarded chunks:
    first tokens within a fifth of collocated's, without its freezes."""
    profile = dataclasses.replace(two_cores(BURST_1B), devices_per_node=2)
    work = sessions((0.0, 1024, 32), (0.39, 1024, 32), (0.43, 1024, 32))
    sim = AdaptiveSimulation(profile, Deployment.parse("adaptive", collocated_size=2))
    adaptive = {r.request_id: r for r in sim.run(work, ArrivalSpec("trace")).records}
    alone = Simulation(profile, Deployment.parse("collocated", collocated_size=2))
    collocated = {r.request_id: r for r in alone.run(work, ArrivalSpec("trace")).records}
    assert sim.decisions[("local", "prefill_queue")] == 2, sim.decisions
    for key, r in collocated.items():
        assert adaptive[key].ttft_s <= 1.2 * r.ttft_s, (key, adaptive[key].ttft_s, r.ttft_s)
    gaps = [r.max_gap_s for r in adaptive.values()]
    assert max(gaps) <= STALL_HEADROOM * 1.0 < max(r.max_gap_s for r in collocated.values())
    assert sim.groups.num_switches == 0  # the decode worker kept both cores
