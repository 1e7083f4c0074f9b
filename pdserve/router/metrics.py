"""Prometheus metrics in the text exposition format, written by hand (no client library).

Per-worker gauges come from each worker's last Stats at scrape time; latency histograms and
request counters are kept here as requests finish. Workers send cumulative totals (KV bytes,
prefix-cache lookups and hits per tier, ...), which are exported as counters as they are: a
worker that restarts starts from zero, which Prometheus' rate() reads as a counter reset.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter[str]()  # by status: success, cancelled, failed, rejected, ...
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            _LATENCY_BUCKETS_S,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            _LATENCY_BUCKETS_S,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            _E2E_BUCKETS_S,
        )

    def record_finished(
        self,
        ttft_s: float | None,
        e2e_s: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))
        self.e2e.observe(e2e_s)
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_output_tokens

    def render(self, workers: list[dict[str, Any]], num_pending: int) -> str:
        """The exposition text; `workers` rows hold worker, role, healthy and Stats fields."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        def per_worker(key: str) -> list[tuple[str, Any]]:
            return [(f'{{worker="{_esc(w["worker"])}"}}', w[key]) for w in workers]

        family("pdserve_worker_healthy", "gauge", "1 if the worker is live.", per_worker("healthy"))
        family("pdserve_queue_length", "gauge", "Requests waiting.", per_worker("num_waiting"))
        family("pdserve_running_requests", "gauge", "Requests running.", per_worker("num_running"))
        family("pdserve_kv_blocks_free", "gauge", "Free KV blocks.", per_worker("num_free_blocks"))
        family("pdserve_kv_blocks_total", "gauge", "KV blocks.", per_worker("num_total_blocks"))
        family(
            "pdserve_router_active_requests",
            "gauge",
            "Requests the router has on the worker now (its own count, not the worker's).",
            per_worker("active_requests"),
        )
        family(
            "pdserve_unacked_releases",
            "gauge",
            "Aborts sent to the worker and not yet acknowledged (Released).",
            per_worker("unacked_releases"),
        )
        family(
            "pdserve_kv_transfer_bytes_total",
            "counter",
            "KV cache bytes sent/received by the worker.",
            [
                (f'{{worker="{_esc(w["worker"])}",direction="{d}"}}', w[f"kv_bytes_{d}"])
                for w in workers
                for d in ("sent", "received")
            ],
        )
        family(
            "pdserve_kv_transfer_skipped_blocks_total",
            "counter",
            "Prompt KV blocks a decode worker already held (prefix cache), so not transferred.",
            per_worker("kv_blocks_skipped"),
        )
        lines.extend(render_cache(workers))
        family("pdserve_pending_requests", "gauge", "Requests in flight.", [("", num_pending)])
        family(
            "pdserve_requests_total",
            "counter",
            "Finished HTTP requests by status.",
            [(f'{{status="{s}"}}', n) for s, n in sorted(self.requests.items())],
        )
        family(
            "pdserve_prompt_tokens_total", "counter", "Prompt tokens.", [("", self.prompt_tokens)]
        )
        family(
            "pdserve_generation_tokens_total",
            "counter",
            "Generated tokens.",
            [("", self.generation_tokens)],
        )
        for histogram in (self.ttft, self.tpot, self.e2e):
            lines.extend(histogram.render())
        return "\n".join(lines) + "\n"


def render_cache(workers: list[dict[str, Any]]) -> list[str]:
    """Prefix-cache families per worker and tier (L1 the worker's pool, L2 host DRAM, L3 disk,
    L4 Redis): hit rate = hits_total / lookups_total, both in blocks."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

    def per_tier(key: str) -> list[tuple[str, Any]]:
        return [
            (f'worker="{_esc(w["worker"])}",tier="{_esc(tier)}"', counts.get(key, 0))
            for w in workers
            for tier, counts in sorted(w.get("kv_tiers", {}).items())
        ]

    def per_worker(key: str) -> list[tuple[str, Any]]:
        return [(f'worker="{_esc(w["worker"])}"', w.get(key, 0)) for w in workers]

    family(
        "pdserve_kv_cache_lookups_total",
        "counter",
        "Prompt blocks looked up in the tier (L2 and below: what the tiers above missed).",
        per_tier("lookups"),
    )
    family(
        "pdserve_kv_cache_hits_total",
        "counter",
        "Prompt blocks found in the tier.",
        per_tier("hits"),
    )
    family(
        "pdserve_kv_tier_bytes_total",
        "counter",
        "Bytes read from / written to the tier (L1: copied down from / loaded into the pool).",
        [
            (f'{labels},direction="{d}"', value)
            for d in ("read", "written")
            for labels, value in per_tier(f"bytes_{d}")
        ],
    )
    family(
        "pdserve_kv_tier_moved_bytes_total",
        "counter",
        "Bytes the tiers below L1 moved between themselves (write-down, promotion).",
        [
            (f'worker="{_esc(w["worker"])}",src="{_esc(src)}",dst="{_esc(dst)}"', num_bytes)
            for w in workers
            for path, num_bytes in sorted(w.get("kv_moved_bytes", {}).items())
            for src, dst in [path.split("->", 1)]
        ],
    )
    family(
        "pdserve_worker_prompt_tokens_total",
        "counter",
        "Prompt tokens a worker prefilled, served from its cache (any tier) or computed.",
        [
            (f'{labels},source="{source}"', value)
            for source in ("cached", "computed")
            for labels, value in per_worker(f"num_{source}_prompt_tokens")
        ],
    )
    family(
        "pdserve_kv_blocks_pinned",
        "gauge",
        "KV blocks pinned by cache warm-up.",
        per_worker("num_pinned_blocks"),
    )
    return lines


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
