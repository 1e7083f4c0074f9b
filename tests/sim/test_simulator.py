"""The simulator against hand-computed timelines (constant-cost profiles), and proof that
pdserve's own scheduler is what runs in it."""

import pytest

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.workloads import Session, Turn
from pdserve.config import SchedulerConfig
from pdserve.costmodel.profile import HardwareProfile, ModelShape, ServedOverhead
from pdserve.costmodel.step_cost import StepCostModel, TransferModel
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.hashing import hash_blocks
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.simulator import Simulation

MODEL = ModelShape("tiny", 2, 64, 128, 4, 2, 16, 128, kv_bytes_per_element=4.0)  # 512 B/token


def profile(
    coefficients=(0.01, 0, 0, 0, 0, 0, 0), kv_tokens=4096, bandwidth=512e3, latency=0.0, served=None
):
    return HardwareProfile(
        kind="measured",
        device="test",
        model=MODEL,
        size_unit="threads",
        models={1: StepCostModel(list(coefficients))},
        transfer={"tcp": TransferModel(bandwidth, latency)},
        devices_per_node=2,
        kv_cache_bytes=kv_tokens * MODEL.kv_bytes_per_token,
        served=served or ServedOverhead(),
    )


def sessions(*specs):
    """(arrival_s, prompt_len, output_len) per single-turn session, distinct prompts."""
    return [
        Session(f"s{i}", [Turn(list(range(1000 * i, 1000 * i + n)), out)], at)
        for i, (at, n, out) in enumerate(specs)
    ]


def run(prof, spec, work, **config):
    sim = Simulation(prof, Deployment.parse(spec), SimConfig(**config))
    result = sim.run(work, ArrivalSpec("trace"))
    return sim, {r.request_id: r for r in result.records}


def test_collocated_timeline_by_hand():
    # 10 ms per step. A: prefill (0-10), decodes end at 20, 30, 40. B arrives at 5 ms and is
    # prefilled together with A's first decode (10-20): TTFT 15 ms, then 30, 40.
    _, records = run(profile(), "collocated", sessions((0.0, 32, 4), (0.005, 32, 3)))
    a, b = records["s0-0"], records["s1-0"]
    assert a.ttft_s == pytest.approx(0.010) and a.e2e_s == pytest.approx(0.040)
    assert a.itl_s == pytest.approx([0.010] * 3) and a.tpot_s == pytest.approx(0.010)
    assert b.ttft_s == pytest.approx(0.015) and b.e2e_s == pytest.approx(0.035)
    assert a.output_len == 4 and b.output_len == 3


def test_the_serving_stack_delays_arrival_and_every_token():
    # 3 ms from the client's send to the worker, 1 ms from a step's end to the client. A
    # reaches the worker at 3 ms: steps 3-13, 13-23, 23-33, seen 1 ms after each end. B,
    # sent at 12 ms, reaches it at 15 ms: mid-step, so it is prefilled 23-33 (TTFT 22 ms).
    prof = profile(served=ServedOverhead(request_s=0.003, token_s=0.001))
    _, records = run(prof, "collocated", sessions((0.0, 32, 3), (0.012, 32, 2)))
    a, b = records["s0-0"], records["s1-0"]
    assert a.ttft_s == pytest.approx(0.014) and a.itl_s == pytest.approx([0.010, 0.010])
    assert a.e2e_s == pytest.approx(0.034)
    assert b.ttft_s == pytest.approx(0.022) and b.e2e_s == pytest.approx(0.032)
    # A next turn leaves the client once it has the last token (1 ms after the step).
    work = [Session("s0", [Turn(list(range(20)), 2), Turn(list(range(100, 110)), 2)], 0.0)]
    _, records = run(prof, "1p1d", work)
    first, second = records["s0-0"], records["s0-1"]
    assert first.ttft_s == pytest.approx(0.003 + 0.010 + 0.001)
    assert second.send_s == pytest.approx(first.e2e_s)


def test_a_prefill_workers_steps_are_its_models_and_its_first_token_pays_the_hop():
    # 10 ms steps, a prefill worker's too; its first token reaches the client 4 ms after the
    # step. Collocated: no hop.
    served = ServedOverhead(remote_token_s=0.004)
    _, records = run(profile(served=served), "1p1d", sessions((0.0, 20, 1), (1.0, 20, 3)))
    one, three = records["s0-0"], records["s1-0"]
    assert one.ttft_s == pytest.approx(0.014) and one.e2e_s == pytest.approx(0.014)
    assert three.ttft_s == pytest.approx(0.014) and three.output_len == 3
    _, records = run(profile(served=served), "collocated", sessions((0.0, 20, 1)))
    assert records["s0-0"].ttft_s == pytest.approx(0.010)


def test_a_decode_worker_starts_once_it_has_both_the_kv_and_the_first_token():
    # 10 ms steps. The prefill step ends at 10 ms; the router has its token 4 ms later and
    # the decode worker starts 3 ms after that (17 ms): steps 17-27, 27-37.
    served = ServedOverhead(remote_token_s=0.004, start_decode_s=0.003)
    _, records = run(profile(bandwidth=1e12, served=served), "1p1d", sessions((0.0, 20, 3)))
    (r,) = records.values()
    assert r.ttft_s == pytest.approx(0.014) and r.itl_s == pytest.approx([0.013, 0.010])
    # 20 tokens' KV (10 kB) at 512 kB/s lands at 20 ms, after the first token: it waits
    _, records = run(profile(served=served), "1p1d", sessions((0.0, 20, 3)))
    (r,) = records.values()
    assert r.ttft_s == pytest.approx(0.014) and r.itl_s == pytest.approx([0.016, 0.010])


def test_a_step_after_idle_time_costs_the_wake_curve_more():
    # 10 ms steps; a step after 0.1 s or more of idle costs 5 ms more, linearly less below.
    # A (at 0) meets a worker idle since the start: 0-15, 15-25. B, sent as A's last step
    # ends, finds it idle 5 ms (+0.25 ms); C, a second later, idle long (+5 ms). Decode steps
    # follow a step at once: no wake.
    prof = profile()
    prof.models[1].wake = [(0.1, 0.005)]
    _, records = run(prof, "collocated", sessions((0.0, 32, 2), (0.030, 32, 2), (1.0, 32, 2)))
    a, b, c = records["s0-0"], records["s1-0"], records["s2-0"]
    assert a.ttft_s == pytest.approx(0.015) and a.itl_s == pytest.approx([0.010])
    assert b.ttft_s == pytest.approx(0.01025) and b.itl_s == pytest.approx([0.010])
    assert c.ttft_s == pytest.approx(0.015)


def test_chunked_prefill_runs_as_the_scheduler_chunks_it():
    # 100 prompt tokens in chunks of 32: 4 steps of 10 ms + 1 ms per prefill token.
    prof = profile((0.01, 0.001, 0, 0, 0, 0, 0))
    _, records = run(
        prof,
        "collocated",
        sessions((0.0, 100, 2)),
        scheduler=SchedulerConfig(long_prefill_token_threshold=32),
    )
    assert records["s0-0"].ttft_s == pytest.approx(4 * 0.010 + 0.100)
    assert records["s0-0"].e2e_s == pytest.approx(4 * 0.010 + 0.100 + 0.010)


def test_disaggregated_timeline_by_hand():
    # Prefill of 64 tokens: 10 ms, first token at 10 ms. KV: 64 x 512 B at 512 kB/s = 64 ms
    # on the wire, 10 ms of it hidden behind the step, + 2 ms latency: lands at 10 + 56 =
    # 66 ms. Two decodes of 10 ms: tokens at 76 and 86 ms.
    prof = profile(latency=0.002)
    _, records = run(prof, "1p1d", sessions((0.0, 64, 3)))
    r = records["s0-0"]
    assert r.ttft_s == pytest.approx(0.010)
    assert r.itl_s == pytest.approx([0.066, 0.010])
    assert r.e2e_s == pytest.approx(0.086)


def test_the_real_scheduler_preempts_when_blocks_run_out(monkeypatch):
    calls = []
    real = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self: calls.append(1) or real(self))
    # 8 blocks of 16 tokens: four 30-token prompts fit, their 40-token answers do not.
    sim, records = run(profile(kv_tokens=128), "collocated", sessions(*[(0.0, 30, 40)] * 4))
    assert calls and sim.workers[0].num_preemptions > 0
    assert all(r.output_len == 40 for r in records.values())


def test_prefix_cache_hits_are_reported_as_bench_reports_them():
    shared = list(range(64))
    work = [Session(f"s{i}", [Turn(shared + [500 + i] * 8, 2)], 0.1 * i) for i in range(3)]
    _, records = run(profile(), "collocated", work)
    assert records["s0-0"].cached_tokens == 0
    assert records["s1-0"].cached_tokens == records["s2-0"].cached_tokens == 64


def test_multi_turn_prompts_carry_the_history():
    work = [Session("s0", [Turn(list(range(20)), 3), Turn(list(range(100, 110)), 2)], 0.0)]
    # prefix_cache routing sends turn 2 back to the worker holding turn 1's blocks.
    _, records = run(profile(), "2c", work, routing="prefix_cache")
    assert records["s0-1"].input_len == 20 + 3 + 10
    assert records["s0-1"].send_s == pytest.approx(records["s0-0"].e2e_s)
    assert records["s0-1"].cached_tokens == 16  # the first turn's full block


@pytest.mark.parametrize("spec", ["collocated", "1p1d"])
def test_a_later_turns_hashes_reuse_the_last_turns_and_match_hashing_it_whole(spec):
    class Recording(Simulation):
        def _arrive(self, flight):
            arrived.append(flight)
            super()._arrive(flight)

    arrived = []
    sim = Recording(profile(), Deployment.parse(spec), SimConfig())
    turns = [Turn(list(range(100 * t, 100 * t + 21)), 19) for t in range(3)]
    result = sim.run([Session("s0", turns, 0.0)], ArrivalSpec("trace"))
    assert [r.input_len for r in result.records] == [21, 61, 101]
    root = sim.workers[0].kv.root_hash
    for flight in arrived:
        assert flight.block_hashes == hash_blocks(flight.prompt_ids, 16, root)
    assert len(arrived[2].block_hashes) == 101 // 16


def test_a_prompt_over_the_context_fails_like_the_engine_refuses_it():
    _, records = run(profile(kv_tokens=64), "1p1d", sessions((0.0, 80, 2), (0.0, 10, 2)))
    assert records["s0-0"].status == "failed" and "context is 64" in records["s0-0"].error
    assert records["s1-0"].ok


def test_bad_deployments_are_refused():
    with pytest.raises(ValueError, match="deployment 'adaptive' shares --collocated-size cores"):
        Deployment.parse("adaptive")
    with pytest.raises(ValueError, match="unknown deployment '2x'"):
        Deployment.parse("2x")
    with pytest.raises(ValueError, match="no cost model for 4 threads"):
        Simulation(profile(), Deployment.parse("collocated", collocated_size=4))


def test_the_router_routes_by_the_last_heartbeat_as_the_real_one_does():
    # 10 ms steps, Stats every 0.5 s. A (t=0) decodes until ~0.8 s on one worker. At B's
    # arrival (0.3 s) the last Stats (t=0) still show both idle: A counts only as the
    # router's own placed request. C (0.2 ms after B) sees B's prompt as sent, not yet
    # prefilled. At D (0.55 s) the 0.5 s Stats show A and B running.
    seen = {}

    class Spy(Simulation):
        def _choose(self, role, flight):
            seen[flight.record.request_id] = {w.worker_id: w.load() for w in self.workers}
            return super()._choose(role, flight)

    sim = Spy(profile(), Deployment.parse("2c"), SimConfig(heartbeat_interval_s=0.5))
    work = sessions((0.0, 32, 80), (0.3, 32, 30), (0.3002, 32, 2), (0.55, 32, 2))
    sim.run(work, ArrivalSpec("trace"))
    at_b, at_c, at_d = seen["s1-0"], seen["s2-0"], seen["s3-0"]
    assert [(w.num_running, w.num_active_requests) for w in at_b.values()] == [(0, 1), (0, 0)]
    assert [w.num_queued_prefill_tokens for w in at_c.values()] == [0, 32]
    assert [w.num_running for w in at_d.values()] == [1, 1]
    assert all(w.sent_prefill_tokens == 0 for w in sim.workers)  # every first token came back


def test_a_heartbeat_during_a_step_carries_the_stats_from_before_it():
    # The real worker refreshes its Stats after each step and reads new requests before the
    # next, so a request that woke it or came during its step is not in its Stats until that
    # step ends. 1 ms + 0.5 ms per prefill token, 512-token chunks, Stats every 0.3 s.
    # A (1,400 tokens, t=0) steps 0-0.257 s and 0.257-0.514 s on c0; B (1,500, t=0.1)
    # steps 0.1-0.357 s on c1. At the 0.3 s heartbeat c0's Stats are those after its first
    # chunk (888 queued: A, counted there, so the router's charge for A is dropped) and c1's
    # those from before B (0), so C at 0.31 s sees c0 at 888 and c1 at 0 + the 1,500 sent
    # (not 1,500 + 1,500), and goes to c0. (Counting both A's charge and the Stats that
    # show A, c0 was 888 + 1,400 and C went to c1.)
    seen = {}

    class Spy(Simulation):
        def _choose(self, role, flight):
            seen[flight.record.request_id] = [w.load() for w in self.workers]
            chosen = super()._choose(role, flight)
            seen[flight.record.request_id + " to"] = chosen.worker_id
            return chosen

    prof = profile(coefficients=(0.001, 0.0005, 0, 0, 0, 0, 0))
    sim = Spy(prof, Deployment.parse("2c"), SimConfig(heartbeat_interval_s=0.3))
    sim.run(sessions((0.0, 1400, 2), (0.1, 1500, 2), (0.31, 100, 2)), ArrivalSpec("trace"))
    assert [w.num_queued_prefill_tokens for w in seen["s2-0"]] == [888, 1500]
    assert [seen[f"s{i}-0 to"] for i in range(3)] == ["c0", "c1", "c0"]
    assert all(not w.unseen and not w.arrived_in_step for w in sim.workers)


def test_the_serving_stacks_cpu_lengthens_steps_only_while_every_core_is_busy():
    prof = profile(served=ServedOverhead(token_cpu_s=0.002))  # two cores, 10 ms steps
    # Alone on one of the two cores: the router and the client take the free one.
    _, alone = run(prof, "2c", sessions((0.0, 32, 3)))
    assert alone["s0-0"].ttft_s == pytest.approx(0.010)
    assert alone["s0-0"].itl_s == pytest.approx([0.010, 0.010])
    # Both workers busy: each step streams one token and costs 2 ms more. A's first step
    # started while B's worker was still idle.
    _, both = run(prof, "2c", sessions((0.0, 32, 3), (0.0, 32, 3)))
    a, b = both["s0-0"], both["s1-0"]
    assert a.ttft_s == pytest.approx(0.010) and a.itl_s == pytest.approx([0.012, 0.012])
    assert b.ttft_s == pytest.approx(0.012) and b.itl_s == pytest.approx([0.012, 0.012])


def test_a_prefill_beside_a_stream_is_its_longest_freeze_which_its_p99_itl_hides():
    # 50 ms a step and 20 ms a prompt token: B's 250-token prompt, arriving while A streams
    # its 120 tokens, is one 5.05 s step that A's decode shares. A's p99 over 119 gaps is the
    # second largest (50 ms): a 108 ms ITL target passes it, a 1 s stall budget does not.
    from pdserve.bench.metrics import SLO, meets_slo, summarize

    _, records = run(
        profile((0.05, 0.02, 0, 0, 0, 0, 0)), "collocated", sessions((0.0, 32, 120), (1.0, 250, 1))
    )
    a = records["s0-0"]
    assert a.max_gap_s == pytest.approx(5.05) and a.p99_itl_s == pytest.approx(0.05)
    assert meets_slo(a, SLO(itl_ms=108)) and not meets_slo(a, SLO(itl_ms=108, max_gap_ms=1000))
    summary = summarize(list(records.values()), SLO(max_gap_ms=1000))
    assert summary["max_gap_ms"] == pytest.approx(5050.0) and summary["slo_attainment"] == 0.5
