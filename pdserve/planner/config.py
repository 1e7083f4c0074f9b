"""The adaptive planner's settings: one frozen dataclass, part of `Pipeline` (YAML key
`adaptive`, flags `--adaptive`, `--adaptive-slo-ttft-ms`, ...) and of `RouterConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import SchedulerConfig
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
    # None: derived per request from the cost model (docs/adaptive.md, "Defaults").
    slo_ttft_ms: float | None = knob(None, "time-to-first-token target (ms)", gt=0)
    slo_itl_ms: float | None = knob(None, "inter-token latency target (ms)", gt=0)
    # None: derived from the cost model (planner/targets.py); 0: no stall budget at all.
    slo_max_gap_ms: float | None = knob(
        None,
        "stall budget (ms): the longest gap a running stream may see because a prompt "
        "prefills beside it (default: derived from the measured decode step; 0: none)",
        ge=0,
    )
    interval_s: float = knob(1.0, "how often the planner re-plans cores and roles", gt=0)
    min_dwell_s: float = knob(30.0, "least time a worker keeps a role", ge=0)
    core_dwell_s: float = knob(
        2.0, "least time a shrink or merge of core groups must stay wanted before it is made", ge=0
    )
    # A Poisson stream leaves a gap of k mean gaps with probability e^-k: at 3, one gap in 20
    # (a merge and a new split every ~20 remote requests); at 10, one in 20000, so that the
    # mean of 16 gaps read 40% short still holds one in ~400.
    core_hold_gaps: float = knob(
        10.0,
        "a shrink or merge of core groups waits this many mean gaps between remote requests "
        "(a merge: after the last one too), at least core_dwell_s",
        ge=0,
    )
    core_hold_max_s: float = knob(
        30.0, "the longest a shrink or merge of core groups waits (core_hold_gaps)", ge=0
    )
    # The workers' chunk size (what a local prefill adds to each decode step there): the
    # launcher sets it from the workers' scheduler, so it is no flag of its own.
    prefill_chunk_tokens: int = knob(
        SchedulerConfig().long_prefill_token_threshold,
        "the workers' prefill chunk",
        gt=0,
        cli=False,
    )
    profile: str | None = knob(None, "pdserve profile JSON seeding the cost model")
    min_samples: int = knob(20, "steps a (role, threads) cost model needs before it is used", ge=1)
    fallback_prompt_tokens: int = knob(
        256, "before the cost model is fitted: longer uncached prompts prefill remotely", ge=0
    )

    def __post_init__(self) -> None:
        check(self)
