"""Where one request's time to first token went: the router's clock and the workers' stamps.

    arrival ─queued─▶ dispatched ─waiting─▶ prefill_start ─prefill─▶ prefill_end
        prefill_end ─first_token─▶ first token at the router (streamed to the client at once)
        prefill_end ─transfer─▶ kv_landed on D ─handover─▶ D's first token at the router

docs/observability.md ("TTFT breakdown") says what each part holds. Router times are
time.monotonic(); worker stamps are time.time() (the clock hosts share), turned into router
time with the wall-minus-monotonic offset taken at arrival. Adjacent parts meet at the same
instant, so the sums are exact; clock skew between hosts moves time between two adjacent
parts, never changes a sum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

try:
    from opentelemetry import trace as _trace
except ImportError:  # optional: pdserve does not depend on it
    _trace = None

PREFILL_STAMPS = {"prefill_start", "prefill_end"}


@dataclass
class RequestTiming:
    arrival: float = field(default_factory=lambda: time.monotonic())
    wall_offset: float = field(default_factory=lambda: time.time() - time.monotonic())
    dispatched: float | None = None  # the attempt that computed the first token
    first_token: float | None = None
    first_decode_token: float | None = None
    stamps: dict[str, float] = field(default_factory=dict)  # workers' time.time() stamps
    itl_s: list[float] = field(default_factory=list)
    _last_token: float | None = None

    def on_dispatch(self) -> None:
        """The router sent the request that computes the prompt (Generate or Prefill)."""
        if self.first_token is None:  # a resumed request keeps its first token's timeline
            self.dispatched = time.monotonic()
            self.stamps.clear()  # an earlier attempt's stamps are not this one's

    def on_tokens(self, num_tokens: int, stamps: dict[str, float] | None, decode: bool) -> None:
        """`num_tokens` arrived from a worker (`decode`: the decode worker of a disaggregated
        request), with its stamps for this request, if any."""
        now = time.monotonic()
        for key, value in (stamps or {}).items():
            self.stamps.setdefault(key, value)
        if self.first_token is None:
            self.first_token = now
        elif num_tokens:
            gap_s = (now - (self._last_token or now)) / num_tokens
            self.itl_s.extend([gap_s] * num_tokens)
        if decode and self.first_decode_token is None:
            self.first_decode_token = now
        if num_tokens:
            self._last_token = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def timeline(self) -> list[tuple[str, float, float]]:
        """(part, start, end) in router time, for the parts known (none before the first
        token or without the workers' stamps; no transfer or handover on one worker)."""
        s = self.stamps
        if self.first_token is None or self.dispatched is None or not s.keys() >= PREFILL_STAMPS:
            return []
        prefill_start = s["prefill_start"] - self.wall_offset
        prefill_end = s["prefill_end"] - self.wall_offset
        parts = [
            ("queued", self.arrival, self.dispatched),
            ("waiting", self.dispatched, prefill_start),
            ("prefill", prefill_start, prefill_end),
            ("first_token", prefill_end, self.first_token),
        ]
        if self.first_decode_token is not None and "kv_landed" in s:
            kv_landed = s["kv_landed"] - self.wall_offset
            parts.append(("transfer", prefill_end, kv_landed))
            parts.append(("handover", kv_landed, self.first_decode_token))
        return parts

    def parts(self) -> dict[str, float]:
        """Each known part's length in seconds."""
        return {part: end - start for part, start, end in self.timeline()}

    def report(self, request_id: str) -> dict[str, Any]:
        """The client's opt-in `pdserve_timing` field."""
        out = {"request_id": request_id, "ttft_s": self.ttft_s, "ttft_parts_s": self.parts()}
        if self.first_decode_token is not None:
            out["first_decode_token_s"] = self.first_decode_token - self.arrival
        return out


def export_span(request_id: str, timing: RequestTiming, status: str) -> None:
    """One OpenTelemetry span per request, a child span per TTFT part, when the
    `opentelemetry` package is installed (where the spans go is the SDK's configuration;
    with the API alone they cost a no-op). Called once per finished request."""
    if _trace is None:
        return
    end = time.monotonic()

    def ns(t: float) -> int:
        return int((t + timing.wall_offset) * 1e9)

    tracer = _trace.get_tracer("pdserve.router")
    attributes = {"pdserve.request_id": request_id, "pdserve.status": status}
    start_ns = ns(timing.arrival)
    span = tracer.start_span("pdserve.request", start_time=start_ns, attributes=attributes)
    context = _trace.set_span_in_context(span)
    for part, start, stop in timing.timeline():
        child = tracer.start_span(f"pdserve.{part}", context=context, start_time=ns(start))
        child.end(end_time=ns(stop))
    span.end(end_time=ns(end))
