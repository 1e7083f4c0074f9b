"""Per-request records and the arithmetic that turns them into a benchmark summary.

No I/O on purpose: every number a user reads comes from here, so it is tested on
hand-made timelines. Times are seconds internally; SLOs are given in milliseconds because that
is how users state them (``--slo-ttft-ms``).

A request that was rejected (HTTP 429/503), failed or timed out stays in every denominator:
it counts as an SLO miss, so overload never makes attainment look better.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

OK = "ok"
REJECTED = "rejected"
FAILED = "failed"
TIMEOUT = "timeout"
STATUSES = (OK, REJECTED, FAILED, TIMEOUT)


@dataclass
class RequestRecord:
    """What one request did, as seen by the client.

    ``send_s`` is relative to the start of the run. ``itl_s`` holds the gaps between
    consecutive non-empty chunks (a chunk may carry several tokens): what a reader sees.
    ``token_gaps_s`` holds them between chunks that carry tokens, text or not, from the
    first non-empty one. A server holds back the text of a lone byte of a multi-byte
    character (random weights emit one in ~1% of tokens): some stream its token as an
    empty chunk, pdserve only with its logprob (`--logprobs`); the reader's gap then spans
    two steps where the stream's own pace is one.
    """

    request_id: str
    input_len: int
    requested_output_len: int
    send_s: float = 0.0
    status: str = OK
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_len: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server says
    itl_s: list[float] = field(default_factory=list)
    token_gaps_s: list[float] = field(default_factory=list)
    error: str = ""
    session_id: str = ""
    turn: int = 0
    server_id: str = ""  # the server's X-Request-Id: joins a record to the router's decisions

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output_len - 1): undefined for fewer than two output tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    @property
    def p99_itl_s(self) -> float | None:
        """The 99th percentile of this request's gaps (nearest rank); None without gaps."""
        if not self.ok or not self.itl_s:
            return None
        gaps = sorted(self.itl_s)
        return gaps[math.ceil(0.99 * len(gaps)) - 1]

    @property
    def max_gap_s(self) -> float | None:
        """This request's longest gap between chunks (its longest freeze); None without gaps.
        Over 100 gaps the p99 ITL passes a lone stall of any length; this does not."""
        if not self.ok or not self.itl_s:
            return None
        return max(self.itl_s)


@dataclass(frozen=True)
class SLO:
    """Latency targets; ``None`` means that target is not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    # Per request: the 99th percentile of its gaps between chunks (nearest rank, so the
    # longest gap for under 100 of them). TPOT averages a stall away; this does not.
    itl_ms: float | None = None
    # Per request: its longest gap between chunks (a stall budget). The p99 of ~100 gaps is
    # the second-largest, so one 5 s freeze passes an ITL target of 100 ms; this catches it.
    max_gap_ms: float | None = None

    def result_fields(self) -> dict[str, float | None]:
        """The targets as a result file names them: slo_ttft_ms, slo_tpot_ms, ..."""
        return {f"slo_{f.name}": getattr(self, f.name) for f in fields(self)}

    def scaled(self, factor: float) -> SLO:
        """Every target times ``factor`` (DistServe's SLO-scale axis)."""
        targets = (self.ttft_ms, self.tpot_ms, self.itl_ms, self.max_gap_ms)
        return SLO(*(None if v is None else v * factor for v in targets))


def latency_stats_ms(values_s: Iterable[float]) -> dict[str, float]:
    """mean/p50/p90/p99 in milliseconds; ``nan`` when nothing was measured."""
    # One array, one partition for the three ranks: a long replay has millions of gaps.
    values = np.fromiter(values_s, dtype=float) * 1000.0
    if not values.size:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(values, (50, 90, 99))
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """True when the request completed and met every target that is set.

    A request with one output token has no TPOT, so only its TTFT is checked.
    """
    if not record.ok or record.ttft_s is None:
        return False
    measured = (
        (slo.ttft_ms, record.ttft_s),
        (slo.tpot_ms, record.tpot_s),
        (slo.itl_ms, record.p99_itl_s),
        (slo.max_gap_ms, record.max_gap_s),
    )
    return all(ms is None or s is None or s * 1000.0 <= ms for ms, s in measured)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of *all* sent requests that met the SLO (0.0 for an empty run)."""
    if not records:
        return 0.0
    return sum(meets_slo(r, slo) for r in records) / len(records)


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last completion; the denominator of every rate."""
    if not records:
        return 0.0
    start = min(r.send_s for r in records)
    end = max(r.send_s + (r.e2e_s or 0.0) for r in records)
    return max(end - start, 1e-9)


def goodput(records: Sequence[RequestRecord], slo: SLO, duration_s: float | None = None) -> float:
    """Requests per second that met the SLO, over the whole run's duration."""
    duration = run_duration_s(records) if duration_s is None else duration_s
    return sum(meets_slo(r, slo) for r in records) / duration if duration > 0 else 0.0


def longest_freeze_ms(records: Iterable[RequestRecord]) -> float:
    """The run's longest freeze: the largest of the requests' longest gaps, in milliseconds
    (``nan`` when no request streamed two chunks)."""
    gaps = [g for r in records if (g := r.max_gap_s) is not None]
    return max(gaps) * 1000.0 if gaps else math.nan


def summarize(
    records: Sequence[RequestRecord], slo: SLO, duration_s: float | None = None
) -> dict[str, object]:
    """The summary block of a result file: counts, throughput, latency percentiles, SLOs."""
    duration = run_duration_s(records) if duration_s is None else duration_s
    done = [r for r in records if r.ok]
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    safe = duration if duration > 0 else math.inf
    num_input, num_output = sum(r.input_len for r in done), sum(r.output_len for r in done)
    num_cached = sum(r.cached_tokens for r in done)
    return {
        "num_requests": len(records),
        "num_completed": counts[OK],
        "num_rejected": counts[REJECTED],
        "num_failed": counts[FAILED],
        "num_timeout": counts[TIMEOUT],
        "duration_s": duration,
        "request_throughput": counts[OK] / safe,
        "input_tokens_per_s": num_input / safe,
        "output_tokens_per_s": num_output / safe,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "total_cached_tokens": num_cached,
        "prefix_cache_hit_rate": num_cached / max(1, num_input),
        "ttft_ms": latency_stats_ms(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot_ms": latency_stats_ms(t for r in done if (t := r.tpot_s) is not None),
        "itl_ms": latency_stats_ms(gap for r in done for gap in r.itl_s),
        "e2e_ms": latency_stats_ms(r.e2e_s for r in done if r.e2e_s is not None),
        "max_gap_ms": longest_freeze_ms(done),
        **slo.result_fields(),
        "slo_attainment": attainment(records, slo),
        "goodput": goodput(records, slo, duration),
    }


def fmt(value: object, spec: str) -> str:
    """Formats a number; missing values (None after JSON cleaning, or nan) print as '-'."""
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return format(value, spec)


def format_summary(summary: dict[str, object]) -> str:
    """A compact human-readable table, like the one vLLM's benchmark prints."""
    rows = [
        (
            "requests (ok/rejected/failed/timeout)",
            f"{summary['num_completed']}/{summary['num_rejected']}/"
            f"{summary['num_failed']}/{summary['num_timeout']}",
        ),
        ("duration (s)", fmt(summary["duration_s"], ".2f")),
        ("request throughput (req/s)", fmt(summary["request_throughput"], ".2f")),
        ("input tokens/s", fmt(summary["input_tokens_per_s"], ".1f")),
        ("output tokens/s", fmt(summary["output_tokens_per_s"], ".1f")),
        ("prompt tokens served from cache", fmt(summary.get("prefix_cache_hit_rate"), ".1%")),
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert isinstance(stats, dict)
        values = " / ".join(fmt(stats[q], ".1f") for q in ("mean", "p50", "p90", "p99"))
        rows.append((f"{key} mean/p50/p90/p99", values))
    rows.append(("longest freeze (max gap, ms)", fmt(summary.get("max_gap_ms"), ".1f")))
    kinds = ("ttft", "tpot", "itl", "max_gap")
    slo = ", ".join(fmt(summary.get(f"slo_{k}_ms"), "g") for k in kinds)
    rows.append(("SLO (ttft, tpot, p99 itl, max gap; ms)", slo))
    rows.append(("SLO attainment", fmt(summary["slo_attainment"], ".3f")))
    rows.append(("goodput (req/s)", fmt(summary["goodput"], ".2f")))
    return "\n".join(f"{name:<40}{value}" for name, value in rows)
