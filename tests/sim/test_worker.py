"""SimWorker's Stats: refreshed after a step at most every `stats_every_s`, as the real
worker's `_maybe_stats`, and without the requests it has not read yet."""

from pdserve.config import SchedulerConfig
from pdserve.costmodel.step_cost import StepCostModel
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.sim.worker import SimWorker


def request(request_id, num_tokens):
    return Request(request_id, list(range(num_tokens)), SamplingParams(max_tokens=50))


def test_stats_lag_a_step_and_refresh_at_most_every_stats_every_s():
    # 10 ms steps, a refresh at most every 25 ms, 64 blocks of 16 tokens.
    worker = SimWorker(
        "w",
        "collocated",
        1,
        StepCostModel([0.01, 0, 0, 0, 0, 0, 0]),
        64,
        16,
        SchedulerConfig(),
        1024,
        stats_every_s=0.025,
    )
    worker.add(request("a", 40))
    worker.start_step(0.0)  # a woke it: its Stats are those from before a
    worker.report()
    assert (worker.reported.num_waiting, worker.reported.num_queued_tokens) == (0, 0)
    worker.finish_step(0.01)  # a refresh (next at 0.035): a is in it, decoding
    worker.start_step(0.01)
    worker.add(request("b", 20))  # during the step: read when the next one starts
    worker.report()
    assert (worker.reported.num_running, worker.reported.num_queued_tokens) == (1, 1)
    assert worker.reported.num_free_blocks == 64 - 3  # a's 41 tokens
    worker.finish_step(0.02)  # no refresh yet: b stays out of the Stats
    worker.start_step(0.02)  # b read and prefilled with a's decode
    worker.report()
    assert (worker.reported.num_waiting, worker.reported.num_queued_tokens) == (0, 1)
    worker.finish_step(0.03)
    worker.start_step(0.03)
    worker.report()  # still the 0.01 s refresh: a decoding, b unseen
    assert (worker.reported.num_running, worker.reported.num_queued_tokens) == (1, 1)
    worker.finish_step(0.04)  # the refresh at 0.035's limit: both running, one token each
    worker.start_step(0.04)
    worker.report()
    assert (worker.reported.num_running, worker.reported.num_queued_tokens) == (2, 2)
    assert not worker.unseen and not worker.arrived_in_step
    worker.finish_step(0.05)  # no refresh (next at 0.065); no step follows yet
    worker.add(request("c", 10))
    worker.report()  # no step running: the idle loop's Stats are the live state
    assert (worker.reported.num_waiting, worker.reported.num_queued_tokens) == (1, 2 + 10)
