"""The per-request decision as a table: each row a situation and the kind and reason the
rule in pdserve/planner/decision.py gives it, on a known machine (tests/planner/conftest.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.decision import DecodeNeed, decide, decode_need
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.pricing import (
    ITL_HEADROOM,
    LOCAL,
    MIN_SLO_CHUNK_TOKENS,
    REMOTE,
    SLO_CHUNK,
    Budgets,
    Candidate,
    Situation,
    predict,
    prefill_s,
)
from pdserve.planner.targets import MIN_STALL_CHUNK_TOKENS, STALL_HEADROOM, max_gap_s
from tests.planner.conftest import ONE_B, SMOLLM, rows, two_cores

BUSY = Situation(
    num_prompt_tokens=4096,
    num_cached_decode_tokens=0,
    num_cached_prefill_tokens=0,
    pool_size=8,
    num_decodes=16,
    decode_context_tokens=8000,
    decode_queue_tokens=0,
    decode_threads_local=8,
    decode_threads_split=4,
    prefill_threads=4,
    prefill_queue_tokens=0,
    prefill_parked=False,
    switch_s=0.0,
    kv_bytes_per_token=9216.0,
    chunk_tokens=512,
)


ONE_THREAD_SPLIT = dataclasses.replace(BUSY, decode_threads_split=1, prefill_threads=7)


@pytest.fixture(scope="module")
def model() -> OnlineCostModel:
    model = OnlineCostModel(min_samples=20)
    for threads in (1, 2, 4, 8):
        model.observe_steps("decode", rows(threads, 100, seed=threads))
    model.refit()
    return model


def case(**changes):
    return dataclasses.replace(BUSY, **changes)


TABLE = [
    # (situation, slo_ttft_s, slo_itl_s, kind, reason)
    (case(has_prefill=False), None, None, LOCAL, "no_prefill_worker"),
    (case(num_decodes=0), None, None, LOCAL, "idle_decode"),
    # idle on its share of a held split: the prompt's chunk steps (on 4 threads) are what a
    # decode joining it waits; with no ITL target that breaks nothing
    (case(num_decodes=0, decode_threads_local=4), None, 0.02, REMOTE, "itl_interference"),
    (case(num_decodes=0, decode_threads_local=4), None, None, LOCAL, "fits_slo"),
    # no ITL target: a local prefill's stall breaks nothing the operator asked for
    (case(), None, None, LOCAL, "fits_slo"),
    # an ITL target of about twice the unloaded step (9 ms here)
    (case(num_prompt_tokens=64), None, 0.02, LOCAL, "fits_slo"),
    (case(), None, 0.02, REMOTE, "itl_interference"),
    # the prompt is cached on the decode worker: 16 tokens left, no interference
    (case(num_cached_decode_tokens=4080), None, 0.02, LOCAL, "fits_slo"),
    # a loose ITL, a TTFT the decode worker's queue breaks and the idle prefill worker meets
    (case(num_prompt_tokens=256, decode_queue_tokens=8192), 0.5, 1.0, REMOTE, "ttft"),
    # budgets nothing meets: the smaller summed relative excess (ITL: remote's split;
    # TTFT: local's whole pool)
    (case(), None, 1e-4, REMOTE, "least_violation"),
    (case(), 0.01, 1.0, LOCAL, "least_violation"),
    # the decode worker's split share (one thread) cannot hold the ITL: local in SLO-sized
    # chunks on every thread does, within the TTFT target or least over it
    (ONE_THREAD_SPLIT, 10.0, 0.02, LOCAL, "slo_chunk"),
    (ONE_THREAD_SPLIT, 0.5, 0.02, LOCAL, "slo_chunk_least_violation"),
    # no chunk of MIN_SLO_CHUNK_TOKENS holds a 5 ms step: back to local or remote
    (ONE_THREAD_SPLIT, 0.5, 0.005, REMOTE, "least_violation"),
    # remote least violates, but its queue alone takes over 3x local's TTFT (0.55 s: 4096
    # queued tokens take 0.84 s, 8192 1.68 s), or the KV it reserves would leave the 16
    # running decodes less than a block each (16 x 16 tokens): local, not one more queued
    (case(prefill_queue_tokens=4096), None, 1e-4, REMOTE, "least_violation"),
    (case(prefill_queue_tokens=8192), None, 1e-4, LOCAL, "remote_backlog"),
    (case(decode_free_tokens=4096, decode_reserve_tokens=256), None, 1e-4, LOCAL, "remote_backlog"),
    (
        case(decode_free_tokens=4352, decode_reserve_tokens=256),
        None,
        1e-4,
        REMOTE,
        "least_violation",
    ),
]


@pytest.mark.parametrize(("situation", "ttft", "itl", "kind", "reason"), TABLE)
def test_decision_table(model, situation, ttft, itl, kind, reason):
    d = decide(situation, model, ttft, itl, fallback_prompt_tokens=256)
    assert (d.kind, d.reason) == (kind, reason), d.predictions


def test_before_the_model_the_fallback_is_the_uncached_prompt_length():
    empty = OnlineCostModel(min_samples=20)
    assert decide(case(num_prompt_tokens=256), empty, None, 0.05, 256).reason == "fallback_short"
    long = decide(case(num_prompt_tokens=257), empty, None, 0.05, 256)
    assert (long.kind, long.reason) == (REMOTE, "fallback_long")
    cached = decide(
        case(num_prompt_tokens=4096, num_cached_decode_tokens=4000), empty, None, 0.05, 256
    )
    assert cached.kind == LOCAL  # prefix hits count: 96 uncached tokens
    no_target = decide(case(num_prompt_tokens=4096), empty, None, None, 256)
    assert (no_target.kind, no_target.reason) == (LOCAL, "no_itl_slo")


def test_remote_prices_the_core_switch_and_the_prefill_queue(model):
    base = decide(case(), model, None, None, 256).predictions
    parked = decide(case(prefill_parked=True, switch_s=0.25), model, None, None, 256).predictions
    queued = decide(case(prefill_queue_tokens=2048), model, None, None, 256).predictions
    assert parked["ttft_remote_s"] == pytest.approx(base["ttft_remote_s"] + 0.25)
    assert queued["ttft_remote_s"] > base["ttft_remote_s"] + 0.1
    assert parked["ttft_local_s"] == base["ttft_local_s"]
    # the queues priced, in tokens beside their seconds (to set against the workers' own)
    both = decide(case(prefill_queue_tokens=2048, decode_queue_tokens=96), model, None, None, 256)
    assert (queued["queue_remote_tokens"], queued["queue_local_tokens"]) == (2048, 0)
    assert (both.predictions["queue_remote_tokens"], both.predictions["queue_local_tokens"]) == (
        2048,
        96,
    )


def test_without_an_itl_target_there_is_no_itl_budget(model):
    p = decide(case(), model, None, None, 256).predictions
    assert p["itl_budget_s"] == math.inf
    assert decide(case(), model, None, 0.05, 256).predictions["itl_budget_s"] == 0.05


def test_a_fit_that_prices_decode_steps_at_nothing_falls_back_instead_of_dividing_by_zero(model):
    """Seen in a served run: prompts queued on a decode worker with nothing decoding yet, and
    a fit whose decode-only step came out 0 s, made the ITL budget 0."""

    class FreeDecodes(OnlineCostModel):
        def step_s(self, role, threads, shape):
            if shape.prefill_tokens == 0:
                return 0.0
            return model.step_s(role, threads, shape)

    queued = case(num_decodes=0, decode_queue_tokens=512, decode_context_tokens=0)
    d = decide(queued, FreeDecodes(min_samples=20), None, 0.05, 256)
    assert (d.kind, d.reason) == (REMOTE, "fallback_long")  # 4,096 uncached tokens
    zero_budget = decide(case(), model, 0.0, 0.0, 256)  # nothing meets a zero budget
    assert zero_budget.reason == "least_violation"


def test_the_slo_chunk_is_the_largest_whose_step_fits_the_itl_headroom(model):
    d = decide(ONE_THREAD_SPLIT, model, 10.0, 0.02, 256)
    chunk, p = d.prefill_chunk_tokens, d.predictions
    assert chunk == p["slo_chunk_tokens"] and MIN_SLO_CHUNK_TOKENS <= chunk < 512

    def last_step(n: int) -> float:  # the prompt's last chunk: the most attention
        s = ONE_THREAD_SPLIT
        pairs = n * (s.num_prompt_tokens - n + (n + 1) / 2)
        shape = StepShape(n, s.num_decodes, pairs, s.decode_context_tokens)
        return model.step_s("decode", s.decode_threads_local, shape)

    assert last_step(chunk) <= ITL_HEADROOM * 0.02 < last_step(chunk + 1)
    assert ITL_HEADROOM * 0.02 * 0.9 < p["itl_slo_chunk_s"] <= last_step(chunk)
    # more, smaller steps: the prompt waits longer than in full chunks
    assert p["ttft_slo_chunk_s"] > p["ttft_local_s"]
    looser = decide(ONE_THREAD_SPLIT, model, 10.0, 0.04, 256)
    assert looser.prefill_chunk_tokens > chunk


def test_no_slo_chunk_without_an_itl_target_or_where_full_chunks_fit(model):
    assert decide(ONE_THREAD_SPLIT, model, 10.0, None, 256).prefill_chunk_tokens is None
    fits = decide(case(num_prompt_tokens=64), model, None, 0.02, 256)
    assert "slo_chunk_tokens" not in fits.predictions and fits.prefill_chunk_tokens is None
    decode_alone_too_long = decide(ONE_THREAD_SPLIT, model, 0.5, 0.005, 256)
    assert "slo_chunk_tokens" not in decode_alone_too_long.predictions


def test_a_queue_on_the_decode_worker_delays_the_slo_chunked_prompt(model):
    base = decide(ONE_THREAD_SPLIT, model, 10.0, 0.02, 256).predictions
    queued = dataclasses.replace(ONE_THREAD_SPLIT, decode_queue_tokens=1024)
    p = decide(queued, model, 10.0, 0.02, 256).predictions
    assert p["ttft_slo_chunk_s"] > base["ttft_slo_chunk_s"] + 0.1


def test_a_path_meets_the_itl_only_within_the_headroom_of_the_target(model):
    """Predictions are mean steps and the target a tail: a split whose step is 90% of the
    target does not meet it; at 70% (inside ITL_HEADROOM) it does."""
    split_s = predict(BUSY, model, None, 1.0).remote.itl_s
    assert ITL_HEADROOM < 0.9
    tight = decide(BUSY, model, None, split_s / 0.9, fallback_prompt_tokens=512)
    loose = decide(BUSY, model, None, split_s / 0.7, fallback_prompt_tokens=512)
    assert tight.reason != "itl_interference"
    assert (loose.kind, loose.reason) == (REMOTE, "itl_interference")


def test_a_backlog_prefills_beside_running_decodes_in_chunks_that_do_not_stall_them(model):
    """The prefill side is backlogged and no SLO-sized chunk fits a 0.1 ms target (the 16
    decodes' own step fills it): local, not in full chunks (one step of 512 prompt tokens
    beside the decodes), but in the largest whose step stays within 1 / ITL_HEADROOM of the
    decodes' own step."""
    d = decide(case(prefill_queue_tokens=8192), model, None, 1e-4, 256)
    assert (d.kind, d.reason) == (LOCAL, "remote_backlog")
    chunk = d.prefill_chunk_tokens
    assert chunk is not None and MIN_SLO_CHUNK_TOKENS <= chunk < 512
    alone = model.step_s("decode", 8, StepShape(0, 16, 0, 8000))
    with_chunk = model.step_s("decode", 8, StepShape(chunk, 16, chunk * (4096 - chunk / 2), 8000))
    full = model.step_s("decode", 8, StepShape(512, 16, 512 * (4096 - 256), 8000))
    assert with_chunk <= alone / ITL_HEADROOM < full
    assert d.predictions["itl_stall_chunk_s"] <= alone / ITL_HEADROOM
    # no decodes run there: nothing to stall, full chunks
    idle = case(prefill_queue_tokens=32768, num_decodes=0, decode_threads_local=4)
    d = decide(idle, model, None, 1e-4, 256)
    assert (d.kind, d.reason, d.prefill_chunk_tokens) == (LOCAL, "remote_backlog", None)


@pytest.mark.parametrize(
    ("num_tokens", "num_cached", "chunk"), [(2048, 0, 2), (1000, 64, 256), (512, 0, 512), (7, 3, 4)]
)
def test_prefill_time_in_closed_form_is_the_sum_of_its_chunk_steps(
    model, num_tokens, num_cached, chunk
):
    """Priced in a few model calls (the router decides on its event loop), and the same as
    pricing every chunk's step."""
    steps, done, left = [], num_cached, num_tokens
    while left:
        n = min(chunk, left)
        steps.append(model.step_s("decode", 1, StepShape(n, 8, n * (done + (n + 1) / 2), 4000)))
        done, left = done + n, left - n
    calls = []

    class Counting:
        def step_s(self, *args):
            calls.append(args)
            return model.step_s(*args)

    total, longest = prefill_s(Counting(), "decode", 1, num_tokens, num_cached, chunk, 8, 4000)
    assert total == pytest.approx(sum(steps), rel=1e-9)
    assert longest == pytest.approx(max(steps), rel=1e-9)
    assert len(calls) <= 3


def test_a_least_violating_local_prefill_beside_decodes_goes_in_stall_bounded_chunks(model):
    """Nothing meets a 5 ms ITL (no SLO-sized chunk fits: the 16 decodes' own step fills it)
    and local least violates (a 0.1 s TTFT): not in full chunks, but in chunks whose step stays
    within 1 / ITL_HEADROOM of the decodes' own; with a 1 s ITL full chunks fit it, unchanged."""
    tight = case(decode_threads_split=1, prefill_threads=1)
    d = decide(tight, model, 0.1, 0.005, 256)
    assert (d.kind, d.reason) == (LOCAL, "least_violation")
    assert "slo_chunk_tokens" not in d.predictions
    alone = model.step_s("decode", 8, StepShape(0, 16, 0, 8000))
    assert d.prefill_chunk_tokens is not None and d.prefill_chunk_tokens < 512
    assert d.predictions["itl_stall_chunk_s"] <= alone / ITL_HEADROOM
    assert decide(case(), model, 0.01, 1.0, 256).prefill_chunk_tokens is None


def test_the_stall_budget_holds_only_running_decodes_and_the_tighter_budget_decides(model):
    # BUSY's local step (a 512-token chunk beside 16 decodes on 8 threads) is ~0.1 s
    d = decide(case(), model, None, None, 256, slo_max_gap_s=0.05)
    assert (d.kind, d.reason) == (REMOTE, "stall_budget")
    assert d.predictions["stall_budget_s"] == d.predictions["itl_budget_s"] == 0.05
    # an ITL target tighter than the stall budget is what the decision names
    d = decide(case(), model, None, 0.02, 256, slo_max_gap_s=0.05)
    assert d.reason == "itl_interference" and "stall_budget_s" not in d.predictions
    # nothing decoding on the decode worker's share of a held split: no one to stall
    idle = case(num_decodes=0, decode_threads_local=4)
    assert decide(idle, model, None, None, 256, slo_max_gap_s=0.05).reason == "fits_slo"
    # an operator's budget before the model is usable: the prompt-length fallback
    empty = OnlineCostModel(min_samples=20)
    assert decide(case(), empty, None, None, 256, slo_max_gap_s=1.0).reason == "fallback_long"


# Decisions and predictions as the string-keyed form priced them, before the Candidate:
# (situation, slo_ttft_s, slo_itl_s, slo_max_gap_s) -> kind, reason, chunk, a few predictions.
PINNED = [
    (
        (case(), None, 0.02, None),
        (REMOTE, "itl_interference", None),
        {
            "ttft_local_s": 0.551907,
            "itl_remote_s": 0.0116,
            "slo_chunk_tokens": 54.0,
            "ttft_slo_chunk_s": 1.048307,
            "ttft_budget_s": 1.65572,
        },
    ),
    (
        (case(prefill_queue_tokens=8192), None, 1e-4, None),
        (LOCAL, "remote_backlog", 12),
        {"ttft_remote_s": 2.691438, "queue_remote_s": 1.680425, "itl_stall_chunk_s": 0.00899},
    ),
    (
        (ONE_THREAD_SPLIT, 0.5, 0.02, None),
        (LOCAL, "slo_chunk_least_violation", 54),
        {"ttft_remote_s": 0.586865, "itl_remote_s": 0.0404, "itl_slo_chunk_s": 0.014873},
    ),
    (
        (case(), None, None, 0.05),
        (REMOTE, "stall_budget", None),
        {"slo_chunk_tokens": 215.0, "itl_slo_chunk_s": 0.037353, "stall_budget_s": 0.05},
    ),
]


@pytest.mark.parametrize(("args", "decided", "predicted"), PINNED)
def test_decisions_and_predictions_are_pinned(model, args, decided, predicted):
    situation, ttft, itl, gap = args
    d = decide(situation, model, ttft, itl, 256, slo_max_gap_s=gap)
    assert (d.kind, d.reason, d.prefill_chunk_tokens) == decided
    assert {k: d.predictions[k] for k in predicted} == pytest.approx(predicted, rel=1e-4)


def test_one_scoring_rule_the_summed_relative_excess_over_the_budgets():
    budgets = Budgets(ttft_s=1.0, itl_s=0.02)
    meets = Candidate(LOCAL, ttft_s=1.0, itl_s=0.02)
    assert meets.meets(budgets) and meets.excess(budgets) == 0.0
    late = Candidate(REMOTE, ttft_s=1.5, itl_s=0.03)  # 50% over each
    assert not late.meets(budgets) and late.excess(budgets) == pytest.approx(1.0)
    chunked = Candidate(SLO_CHUNK, ttft_s=2.5, itl_s=0.01, chunk_tokens=64)  # TTFT 150% over
    assert min((meets, late, chunked), key=lambda c: c.excess(budgets)) is meets
    assert min((chunked, late), key=lambda c: c.excess(budgets)) is late


@pytest.mark.parametrize(("bytes_per_s", "kind"), [(1e10, REMOTE), (1e7, LOCAL)])
def test_the_measured_link_decides_whether_a_long_prompt_goes_remote(bytes_per_s, kind):
    """The situation that goes remote for its ITL (the table) over a link its prefill hides
    (37.7 MB of KV: 4 ms at 10 GB/s), stays local over 10 MB/s: 3.8 s on the wire, of which
    the ~1 s remote prefill hides only that much, so the first decoded gap breaks the ITL."""
    model = OnlineCostModel(min_samples=20)
    for threads in (1, 2, 4, 8):
        model.observe_steps("decode", rows(threads, 100, seed=threads))
    model.observe_link("prefill-0", 64e6, 64e6 / bytes_per_s)  # what its sends measured
    model.refit()
    d = decide(case(), model, None, 0.02, fallback_prompt_tokens=256)
    assert d.kind == kind, d.predictions
    wire_s = 4096 * 9216.0 / bytes_per_s
    remote_prefill_s = d.predictions["ttft_remote_s"]  # no queue, no core switch
    assert d.predictions["transfer_s"] == pytest.approx(max(0.0, wire_s - remote_prefill_s))


def two_core_situation(need: DecodeNeed, num_decodes: int = 3) -> Situation:
    """A 1,024-token prompt arriving at a decode worker with every core of two, its prefill
    worker parked: the README's 1B cell on two cores."""
    return Situation(
        num_prompt_tokens=1024,
        num_cached_decode_tokens=0,
        num_cached_prefill_tokens=0,
        pool_size=2,
        num_decodes=num_decodes,
        decode_context_tokens=num_decodes * 1100,
        decode_queue_tokens=0,
        decode_threads_local=2,
        decode_threads_split=need.split,
        prefill_threads=2 - need.split,
        prefill_queue_tokens=0,
        prefill_parked=True,
        switch_s=0.01,
        kv_bytes_per_token=32768.0,
        chunk_tokens=512,
        split_breaks_stall=need.split_breaks_stall,
    )


def test_no_split_takes_a_1b_batch_past_the_stall_budget():
    model = OnlineCostModel(min_samples=20, profile=two_cores(ONE_B))
    budget = max_gap_s(AdaptiveConfig(enabled=True), model, 2)  # told no targets
    assert budget == pytest.approx(1.8)  # 10 x one decode's 0.18 s on two threads
    shape = StepShape(0, 5, 0, 5500)  # five decodes alone
    assert model.step_s("decode", 1, shape) > ITL_HEADROOM * budget  # 1.8 s > 1.35 s
    assert model.step_s("decode", 2, shape) <= ITL_HEADROOM * budget  # 0.82 s
    need = decode_need(model, 2, 5, 5500, None, budget)
    assert (need.threads, need.stall_threads, need.split_breaks_stall) == (2, 2, True)
    situation = two_core_situation(need, num_decodes=5)
    d = decide(situation, model, None, None, 256, budget, True)
    assert (d.kind, d.reason) == (LOCAL, "stall_split")
    assert d.prefill_chunk_tokens is not None and d.prefill_chunk_tokens < 512
    # its chunk's step, on both cores beside the five decodes, within the step budget
    assert d.predictions["itl_slo_chunk_s"] <= ITL_HEADROOM * budget
    # Behind 2,048 queued prompt tokens, told an 8 s TTFT, remote would be the newcomer's
    # least violation (10 s to its first token against 40 s): the rule keeps it local, as
    # the split would freeze every running stream (their steps 1.8 s on one core)
    queued = dataclasses.replace(situation, decode_queue_tokens=2048)
    kept = decide(queued, model, 8.0, None, 256, budget, True)
    assert (kept.kind, kept.reason) == (LOCAL, "stall_split")
    free = dataclasses.replace(queued, split_breaks_stall=False)
    old = decide(free, model, 8.0, None, 256, budget, True)
    assert (old.kind, old.reason) == (REMOTE, "least_violation")
    assert old.predictions["itl_remote_s"] >= 2 * model.step_s("decode", 1, shape)


def test_a_remote_requests_first_gap_spans_two_of_the_splits_steps():
    # Three decodes take 1.1 s a step on one core: a split holds the running streams within
    # the 1.8 s budget, but a request whose KV lands waits for the step in flight, then its
    # own (2.2 s). The prompt goes local in chunks that hold every gap, on both cores.
    model = OnlineCostModel(min_samples=20, profile=two_cores(ONE_B))
    budget = max_gap_s(AdaptiveConfig(enabled=True), model, 2)
    step = model.step_s("decode", 1, StepShape(0, 3, 0, 3300))
    assert STALL_HEADROOM * budget < step <= ITL_HEADROOM * budget  # 0.81 < 1.1 <= 1.35 s
    need = decode_need(model, 2, 3, 3300, None, budget)
    assert (need.stall_threads, need.split, need.split_breaks_stall) == (1, 1, False)
    d = decide(two_core_situation(need), model, None, None, 256, budget, True)
    assert (d.kind, d.reason) == (LOCAL, "slo_chunk"), d.predictions
    assert d.predictions["itl_remote_s"] >= 2 * step
    assert d.predictions["itl_slo_chunk_s"] <= ITL_HEADROOM * budget
    # one decode fits one core (0.4 s): the split holds, and its first gap (0.8 s) too
    one = decode_need(model, 2, 1, 1100, None, budget)
    assert (one.stall_threads, one.split, one.split_breaks_stall) == (1, 1, False)


# A 1B Q4_K_M model as the current kernels run it on two cores: one decode 26 ms a step on
# two threads, three 66 ms on one, a prompt token 2 ms on two and 4 ms on one.
ONE_B_Q4_K = {2: [0.014, 2e-3, 0.012, 0, 0, 0, 0], 1: [0.03, 4e-3, 0.012, 0, 0, 0, 0]}


def test_a_split_is_sized_by_the_decodes_steps_not_a_local_chunk_it_would_not_run():
    # Told a 257 ms stall budget (10x the step) and a 5 s TTFT: three decodes take 66 ms on
    # one thread, within 45% of the budget, so a split holds them, although beside the
    # guard's least chunk (16 tokens, 64 ms more) they would not. The 512-token prompt goes
    # remote, as static 1P1D sends it; counting that chunk sent it local in 30-55-token
    # chunks, 10-14 s to its first token, in the 1B grid's 512-token cells.
    model = OnlineCostModel(min_samples=20, profile=two_cores(ONE_B_Q4_K))
    budget = 0.257
    with_chunk = StepShape(MIN_STALL_CHUNK_TOKENS, 3, 136, 1800)
    assert model.step_s("decode", 1, with_chunk) > STALL_HEADROOM * budget  # 0.13 s > 0.116 s
    need = decode_need(model, 2, 3, 1800, None, budget)
    assert (need.stall_threads, need.split, need.split_breaks_stall) == (1, 1, False)
    situation = dataclasses.replace(two_core_situation(need), num_prompt_tokens=512)
    d = decide(situation, model, 5.0, None, 256, budget, True)
    assert (d.kind, d.reason) == (REMOTE, "stall_budget")
    # its own first gap, two of the split's steps, within the budget's headroom
    assert d.predictions["itl_remote_s"] <= ITL_HEADROOM * budget
    assert d.predictions["ttft_remote_s"] <= 5.0


def test_a_split_that_holds_the_running_streams_is_weighed_on_ttft_against_tiny_chunks():
    # Twelve decodes and 1,024 prompt tokens queued on the decode worker, a 257 ms budget:
    # on one core the decodes take 174 ms a step, over the guard's 45% (116 ms) but within
    # the headroom (193 ms): a split holds the running streams. Local, beside the decodes
    # on both cores (158 ms), has room for 17-token chunks: 17 s to the first token. Remote
    # costs the newcomer a 348 ms first gap, and 2 s. Holding the decodes to 45% sent such
    # prompts local in 4-token chunks (23-28 s to their first token on the 1B grid).
    model = OnlineCostModel(min_samples=20, profile=two_cores(ONE_B_Q4_K))
    budget = 0.257
    need = decode_need(model, 2, 12, 7200, None, budget)
    assert (need.stall_threads, need.split, need.split_breaks_stall) == (1, 1, False)
    situation = dataclasses.replace(
        two_core_situation(need, num_decodes=12), num_prompt_tokens=512, decode_queue_tokens=1024
    )
    d = decide(situation, model, 5.0, None, 256, budget, True)
    p = d.predictions
    assert (d.kind, d.reason) == (REMOTE, "least_violation"), p
    assert p["ttft_slo_chunk_s"] > 3 * p["ttft_remote_s"]


def test_at_smollm_step_times_the_split_happens_as_before():
    model = OnlineCostModel(min_samples=20, profile=two_cores(SMOLLM))
    budget = max_gap_s(AdaptiveConfig(enabled=True), model, 2)
    assert budget == 1.0  # the floor: ten 8 ms steps are well under it
    need = decode_need(model, 2, 3, 3300, None, budget)
    assert need.stall_threads == 1 and not need.split_breaks_stall
    assert need == dataclasses.replace(decode_need(model, 2, 3, 3300, None), stall_threads=1)
    assert need.split == 1
    d = decide(two_core_situation(need), model, None, None, 256, budget, True)
    assert d.reason != "stall_split"
    # no stall budget (off): nothing to size for
    assert decode_need(model, 2, 3, 3300, None, None).stall_threads == 0


def test_a_prompt_queued_behind_the_prefill_worker_prefills_locally_when_that_is_sooner(model):
    """Both meet the budgets; remote waits behind the prefill worker's queue: the earlier
    first token decides. With no queue, remote stays the answer where it meets both."""
    free = decide(case(num_prompt_tokens=1024), model, 10.0, 0.02, 256)
    assert (free.kind, free.reason) == (REMOTE, "itl_interference"), free.predictions
    queued = decide(case(num_prompt_tokens=1024, prefill_queue_tokens=8192), model, 10.0, 0.02, 256)
    p = queued.predictions
    assert (queued.kind, queued.reason) == (LOCAL, "prefill_queue"), p
    assert p["ttft_slo_chunk_s"] < p["ttft_remote_s"] <= 10.0
    assert queued.prefill_chunk_tokens == p["slo_chunk_tokens"]
    # a queue on both sides, the decode worker's longer: remote, as before
    both = case(num_prompt_tokens=1024, prefill_queue_tokens=512, decode_queue_tokens=2048)
    later = decide(both, model, 10.0, 0.02, 256)
    assert later.kind == REMOTE, later.predictions
    assert later.predictions["ttft_slo_chunk_s"] >= later.predictions["ttft_remote_s"]


def test_under_the_stall_budget_a_split_that_slows_the_decode_workers_queue_counts_against_remote():
    """The README's 1B cell on two cores: a prompt arrives while another prefills on the
    decode worker. Remote would split the pool, and the prompt queued there would finish on
    one core: that slowdown (`split_delay_s`) is weighed against remote's earlier token."""
    model = OnlineCostModel(min_samples=20, profile=two_cores(ONE_B))
    budget = max_gap_s(AdaptiveConfig(enabled=True), model, 2)
    situation = two_core_situation(decode_need(model, 2, 1, 1100, None, budget), num_decodes=1)
    alone = decide(situation, model, None, None, 256, budget, True)
    assert (alone.kind, alone.reason, alone.predictions["split_delay_s"]) == (
        REMOTE,
        "stall_budget",
        0.0,
    )
    behind = dataclasses.replace(situation, decode_queue_tokens=1024)
    d = decide(behind, model, None, None, 256, budget, True)
    p = d.predictions
    assert (d.kind, d.reason) == (LOCAL, "prefill_queue"), p
    assert p["ttft_remote_s"] < p["ttft_slo_chunk_s"] < p["ttft_remote_s"] + p["split_delay_s"]
    # an ITL target fixes the chunk when sent, so a later split is not priced away: remote
    itl = decide(behind, model, None, budget, 256)
    assert itl.kind == REMOTE, itl.predictions
