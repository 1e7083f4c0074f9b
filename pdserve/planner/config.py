"""The adaptive planner's settings: one frozen dataclass, part of `Pipeline` (YAML key
`adaptive`, flags `--adaptive`, `--adaptive-slo-ttft-ms`, ...) and of `RouterConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.schema import check, knob


@dataclass(frozen=True)
class AdaptiveConfig:
    """An adaptive deployment: `workers` workers on one pool of cores; the planner decides per
    request whether to prefill remotely or on the decode worker, moves cores between the
    prefill and decode groups, and changes workers' roles (docs/adaptive.md)."""

    enabled: bool = knob(
        False, "decide per request and per core where prefill runs", flag="adaptive"
    )
    workers: int = knob(2, "workers of an adaptive deployment", ge=2)
    slo_ttft_ms: float | None = knob(None, "time-to-first-token target (ms)", gt=0)
    slo_itl_ms: float | None = knob(None, "inter-token latency target (ms)", gt=0)
    interval_s: float = knob(1.0, "how often the planner re-plans cores and roles", gt=0)
    min_dwell_s: float = knob(30.0, "least time a worker keeps a role", ge=0)

    def __post_init__(self) -> None:
        check(self)
