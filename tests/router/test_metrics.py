"""RouterMetrics without a cluster: what one finished request records, per-router registries,
and the exposition of worker rows (escaping, large values) as a Prometheus parser reads it."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics

ROW = {
    "worker": 'w"1\\x',
    "healthy": 1,
    "num_waiting": 2,
    "num_running": 3,
    "num_free_blocks": 60,
    "num_total_blocks": 64,
    "kv_bytes_sent": 12_345_678_901,
    "kv_bytes_received": 9,
    "kv_blocks_skipped": 3,
    "active_requests": 2,
    "unacked_releases": 0,
    "kv_tiers": {"L1": {"lookups": 10, "hits": 4, "bytes_read": 5, "bytes_written": 6}},
    "kv_moved_bytes": {"L2->L3": 300},
    "kv_transfer_fallbacks": {"shm_to_tcp": 2},
    "weights_widened": {"dtype_F64": 3},
}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_finished_requests_fill_histograms_and_counters():
    m = RouterMetrics()
    m.record_finished(0.05, 1.05, num_prompt_tokens=7, num_output_tokens=11)
    m.record_finished(None, 0.3, num_prompt_tokens=2, num_output_tokens=1)  # no first token
    m.requests["success"] += 2
    got = samples(m.render([], num_pending=4))
    none = frozenset()
    assert got["pdserve_prompt_tokens_total", none] == 9
    assert got["pdserve_generation_tokens_total", none] == 12
    assert got["pdserve_time_to_first_token_seconds_count", none] == 1
    assert got["pdserve_time_per_output_token_seconds_sum", none] == 0.1  # 1 s over 10 gaps
    assert got["pdserve_e2e_request_latency_seconds_bucket", frozenset({("le", "0.25")})] == 0
    assert got["pdserve_e2e_request_latency_seconds_bucket", frozenset({("le", "0.5")})] == 1
    assert got["pdserve_e2e_request_latency_seconds_count", none] == 2
    assert got["pdserve_requests_total", frozenset({("status", "success")})] == 2
    assert got["pdserve_pending_requests", none] == 4
    assert not any(name.endswith("_created") for name, _ in got)


def test_routers_in_one_process_keep_their_own_series():
    a, b = RouterMetrics(), RouterMetrics()  # a shared registry would refuse the second
    a.record_finished(0.1, 0.2, 1, 2)
    assert samples(a.render([], 0))["pdserve_prompt_tokens_total", frozenset()] == 1
    assert samples(b.render([], 0))["pdserve_prompt_tokens_total", frozenset()] == 0


def test_worker_rows_are_escaped_typed_and_exact():
    text = RouterMetrics().render([ROW], num_pending=0)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["pdserve_kv_transfer_bytes"].type == "counter"
    assert families["pdserve_kv_blocks_free"].type == "gauge"
    assert families["pdserve_kv_blocks_free"].documentation == "Free KV blocks."
    got = samples(text)
    worker = ("worker", 'w"1\\x')
    sent = frozenset({worker, ("direction", "sent")})
    assert got["pdserve_kv_transfer_bytes_total", sent] == 12_345_678_901
    tier = frozenset({worker, ("tier", "L1"), ("direction", "written")})
    assert got["pdserve_kv_tier_bytes_total", tier] == 6
    moved = frozenset({worker, ("src", "L2"), ("dst", "L3")})
    assert got["pdserve_kv_tier_moved_bytes_total", moved] == 300
    fallback = frozenset({worker, ("reason", "shm_to_tcp")})
    assert got["pdserve_kv_transfer_fallbacks_total", fallback] == 2
    widened = frozenset({worker, ("reason", "dtype_F64")})
    assert got["pdserve_weights_widened_total", widened] == 3
    assert got["pdserve_worker_prompt_tokens_total", frozenset({worker, ("source", "cached")})] == 0


def test_token_gaps_and_ttft_parts_are_histograms():
    m = RouterMetrics()
    m.record_finished(0.1, 0.4, 3, 4, itl_s=[0.01, 0.05, 0.2], ttft_parts_s={"prefill": 0.08})
    got = samples(m.render([], 0))
    bucket = "pdserve_inter_token_latency_seconds_bucket"
    assert got[bucket, frozenset({("le", "0.01")})] == 1  # le is inclusive
    assert got[bucket, frozenset({("le", "0.05")})] == 2
    assert got[bucket, frozenset({("le", "+Inf")})] == 3
    assert got["pdserve_inter_token_latency_seconds_sum", frozenset()] == 0.26
    part = frozenset({("part", "prefill"), ("le", "0.1")})
    assert got["pdserve_ttft_part_seconds_bucket", part] == 1
