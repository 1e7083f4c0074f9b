"""Metric arithmetic on hand-made timelines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.metrics import (
    FAILED,
    REJECTED,
    SLO,
    TIMEOUT,
    RequestRecord,
    attainment,
    format_summary,
    goodput,
    latency_stats_ms,
    meets_slo,
    summarize,
)
from pdserve.bench.search import find_goodput, slo_scale_sweep


def ok(send_s: float, ttft_s: float, e2e_s: float, output_len: int, input_len: int = 10):
    return RequestRecord(
        "r", input_len, output_len, send_s, ttft_s=ttft_s, e2e_s=e2e_s, output_len=output_len
    )


def test_ttft_tpot_from_timeline():
    # First token at 100 ms, 10 tokens by 1000 ms: 9 gaps over 900 ms.
    record = ok(0.0, 0.1, 1.0, 10)
    assert record.tpot_s == pytest.approx(0.1)
    assert meets_slo(record, SLO(ttft_ms=100, tpot_ms=100))
    assert not meets_slo(record, SLO(ttft_ms=99))
    assert not meets_slo(record, SLO(tpot_ms=99))


def test_itl_slo_checks_each_requests_p99_gap_which_tpot_averages_away():
    # 101 tokens, 100 gaps of 10 ms but one 500 ms stall: TPOT 14.9 ms, p99 gap 10 ms.
    record = ok(0.0, 0.1, 0.1 + 0.99 + 0.5, 101)
    record.itl_s = [0.01] * 99 + [0.5]
    assert record.p99_itl_s == pytest.approx(0.01)
    assert meets_slo(record, SLO(tpot_ms=20, itl_ms=10))
    record.itl_s = [0.01] * 98 + [0.5, 0.5]  # two stalls: the p99 gap is a stall
    assert record.p99_itl_s == pytest.approx(0.5)
    assert not meets_slo(record, SLO(tpot_ms=20, itl_ms=100))
    assert meets_slo(record, SLO(itl_ms=100).scaled(5))
    short = ok(0.0, 0.1, 0.4, 3)
    short.itl_s = [0.1, 0.2]  # under 100 gaps: the longest one counts
    assert short.p99_itl_s == pytest.approx(0.2)
    assert ok(0.0, 0.1, 0.1, 1).p99_itl_s is None


def test_a_five_second_freeze_passes_the_p99_itl_but_fails_the_stall_budget():
    # 101 tokens 50 ms apart but one 5 s freeze: the p99 of 100 gaps is the second largest,
    # 50 ms, so a 108 ms ITL target passes it; a 1 s stall budget does not.
    record = ok(0.0, 0.1, 0.1 + 99 * 0.05 + 5.0, 101)
    record.itl_s = [0.05] * 50 + [5.0] + [0.05] * 49
    assert record.p99_itl_s == pytest.approx(0.05) and record.max_gap_s == pytest.approx(5.0)
    assert meets_slo(record, SLO(itl_ms=108))
    assert not meets_slo(record, SLO(itl_ms=108, max_gap_ms=1000))
    assert meets_slo(record, SLO(max_gap_ms=1000).scaled(5))
    smooth = ok(1.0, 0.1, 0.1 + 100 * 0.05, 101)
    smooth.itl_s = [0.05] * 100
    slo = SLO(ttft_ms=200, itl_ms=108, max_gap_ms=1000)
    summary = summarize([record, smooth], slo)
    assert summary["max_gap_ms"] == pytest.approx(5000.0)  # the run's longest freeze
    assert summary["itl_ms"]["p99"] < 108 and summary["slo_max_gap_ms"] == 1000
    assert summary["slo_attainment"] == 0.5
    assert summary["goodput"] == pytest.approx(1 / summary["duration_s"])
    text = format_summary(summary)
    assert "longest freeze (max gap, ms)".ljust(40) + "5000.0" in text.splitlines()
    assert text.splitlines()[-3].endswith("200, -, 108, 1000")
    failed = RequestRecord("f", 10, 5, 0.0, status=FAILED, itl_s=[9.0])
    assert failed.max_gap_s is None and ok(0.0, 0.1, 0.1, 1).max_gap_s is None
    assert math.isnan(summarize([failed], SLO())["max_gap_ms"])


def test_single_token_has_no_tpot_and_only_ttft_is_checked():
    record = ok(0.0, 0.05, 0.05, 1)
    assert record.tpot_s is None
    assert meets_slo(record, SLO(ttft_ms=60, tpot_ms=1))


def test_rejected_failed_and_timed_out_requests_are_misses_in_the_denominator():
    records = [
        ok(0.0, 0.1, 0.5, 5),  # meets
        ok(0.5, 0.1, 1.5, 5),  # meets, ends at 2.0 s: run duration 2.0 s
        ok(1.0, 0.9, 1.0, 5),  # TTFT miss
        RequestRecord("x", 10, 5, 1.0, status=REJECTED, http_status=503, e2e_s=0.01),
        RequestRecord("y", 10, 5, 1.0, status=FAILED, e2e_s=0.01),
        RequestRecord("z", 10, 5, 1.0, status=TIMEOUT, ttft_s=0.1, e2e_s=0.5),
    ]
    slo = SLO(ttft_ms=200, tpot_ms=500)
    assert attainment(records, slo) == pytest.approx(2 / 6)
    assert goodput(records, slo) == pytest.approx(2 / 2.0)
    summary = summarize(records, slo)
    assert summary["num_requests"] == 6
    assert (summary["num_rejected"], summary["num_failed"], summary["num_timeout"]) == (1, 1, 1)
    assert summary["num_completed"] == 3
    assert summary["duration_s"] == pytest.approx(2.0)
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_tokens_per_s"] == pytest.approx(15 / 2.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["goodput"] == pytest.approx(1.0)


def test_a_summary_of_nothing_is_nan():
    assert math.isnan(summarize([], SLO())["ttft_ms"]["mean"])


def test_latency_stats_are_milliseconds_of_the_values_and_nan_without_any():
    values_s = [0.005, 0.001, 0.009, 0.003, 0.007, 0.002]
    stats = latency_stats_ms(iter(values_s))  # any iterable, read once
    assert stats["mean"] == pytest.approx(1000 * sum(values_s) / len(values_s))
    for q in (50, 90, 99):
        assert stats[f"p{q}"] == pytest.approx(np.percentile(values_s, q) * 1000)
    assert all(math.isnan(v) for v in latency_stats_ms([]).values())


def test_find_goodput_brackets_then_bisects_within_probe_budget():
    knee = 5.3
    search = find_goodput(lambda rate: 1.0 if rate <= knee else 0.5, start_rate=1.0, max_probes=8)
    assert len(search.probes) <= 8
    assert 4.0 <= search.best_rate <= knee
    assert [r for r, _ in search.probes[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert search.best_rate > 4.0  # bisection improved on the exponential bracket


def test_find_goodput_searches_down_and_reports_zero_when_nothing_passes():
    down = find_goodput(lambda rate: 1.0 if rate <= 0.3 else 0.0, start_rate=2.0, max_probes=6)
    assert [r for r, _ in down.probes[:4]] == [2.0, 1.0, 0.5, 0.25]
    assert 0.25 <= down.best_rate <= 0.3
    never = find_goodput(lambda rate: 0.0, max_probes=3)
    assert never.best_rate == 0.0 and len(never.probes) == 3


def test_slo_scale_sweep_loosening_never_lowers_attainment():
    records = [ok(0.0, t, t + 0.4, 11) for t in (0.05, 0.1, 0.2, 0.4)]  # TPOT 40 ms
    rows = slo_scale_sweep(records, SLO(ttft_ms=100, tpot_ms=100), [0.5, 1, 2, 4], 2.0)
    values = [row["attainment"] for row in rows]
    assert values == [0.25, 0.5, 0.75, 1.0]
    assert rows[1]["goodput"] == pytest.approx(2 / 2.0)
    assert rows[2]["slo_ttft_ms"] == 200
    stalled = ok(0.0, 0.05, 2.05, 3)
    stalled.itl_s = [0.5, 1.5]  # a 1.5 s freeze: within a 1 s budget only from scale 2
    rows = slo_scale_sweep([stalled], SLO(max_gap_ms=1000), [1, 2], 2.0)
    assert [(r["slo_max_gap_ms"], r["attainment"]) for r in rows] == [(1000, 0.0), (2000, 1.0)]
