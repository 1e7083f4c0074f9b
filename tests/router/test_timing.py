"""RequestTiming: the parts of a TTFT meet end to end, so they add up to it exactly."""

from __future__ import annotations

import pytest

from pdserve.router import timing as timing_module
from pdserve.router.timing import RequestTiming


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(timing_module.time, "monotonic", clock)
    return clock


def test_parts_add_up_to_ttft_and_to_the_first_decode_token(clock: Clock) -> None:
    t = RequestTiming(wall_offset=1000.0)  # wall clock = monotonic + 1000 on this host
    clock.now = 50.5
    t.on_dispatch()
    clock.now = 51.25
    prefill = {"prefill_start": 1050.75, "prefill_end": 1051.0}
    t.on_tokens(1, prefill, decode=False)
    clock.now = 52.0
    t.on_tokens(1, {"kv_landed": 1051.5}, decode=True)
    clock.now = 52.5
    t.on_tokens(2, None, decode=True)
    parts = t.parts()
    assert parts == {
        "queued": 0.5,
        "waiting": 0.25,
        "prefill": 0.25,
        "first_token": 0.25,
        "transfer": 0.5,
        "handover": 0.5,
    }
    assert sum(parts[p] for p in ("queued", "waiting", "prefill", "first_token")) == t.ttft_s
    assert t.ttft_s == 1.25
    ttfdt = sum(parts[p] for p in ("queued", "waiting", "prefill", "transfer", "handover"))
    assert ttfdt == t.first_decode_token - t.arrival == 2.0
    assert t.itl_s == [0.75, 0.25, 0.25]  # the second chunk's two tokens share its gap
    assert t.report("cmpl-x")["first_decode_token_s"] == 2.0


def test_a_new_attempt_drops_the_earlier_ones_stamps(clock: Clock) -> None:
    t = RequestTiming(wall_offset=0.0)
    t.on_dispatch()
    t.stamps["prefill_start"] = 50.0  # a stamp of an attempt whose worker died
    clock.now = 51.0
    t.on_dispatch()
    assert t.stamps == {} and t.dispatched == 51.0
    t.on_tokens(1, None, decode=False)
    assert t.parts() == {}  # a worker that sent no stamps: no breakdown, no guess
    clock.now = 52.0
    t.on_dispatch()  # a resumed request keeps its first token's timeline
    assert t.dispatched == 51.0


def test_opentelemetry_spans_follow_the_timeline(clock: Clock) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    t = RequestTiming(wall_offset=1000.0)
    clock.now = 50.5
    t.on_dispatch()
    clock.now = 51.0
    t.on_tokens(1, {"prefill_start": 1050.75, "prefill_end": 1050.9}, decode=False)
    clock.now = 51.5
    timing_module.export_span("cmpl-7", t, "success")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "pdserve.request",
        "pdserve.queued",
        "pdserve.waiting",
        "pdserve.prefill",
        "pdserve.first_token",
    }
    root = spans["pdserve.request"]
    assert root.attributes["pdserve.request_id"] == "cmpl-7"
    assert (root.start_time, root.end_time) == (1050 * 10**9, 1051_500_000_000)
    assert spans["pdserve.prefill"].parent.span_id == root.context.span_id
    assert spans["pdserve.prefill"].start_time == 1050_750_000_000
