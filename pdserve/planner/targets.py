"""The targets an adaptive deployment's decisions aim at: the operator's (`AdaptiveConfig`),
else derived from what the cost model measured on this host (docs/adaptive.md, "Default
targets"). Pure, like decision.py: the router's planner and the simulator both call it.

The stall budget (`max_gap_s`) bounds the longest gap a running stream may see between two
tokens because a prompt prefills beside it. Unset, it is

    max(STALL_STEP_FACTOR x the unloaded decode step, MIN_STALL_S)

- the unloaded step: one decode attending UNLOADED_CONTEXT_TOKENS on every core of the
  pool, as the cost model prices it (a profile seeds it, or `min_samples` steps of this
  host). With context: an online fit may put a decode's whole cost on the tokens it attends
  (SmolLM2-135M on two cores: 0 s a step and a request, 14 us a context token), so one
  decode attending nothing is priced at 0;
- STALL_STEP_FACTOR (10): ten tokens' time. A stream's own step is its pace; a gap of ten
  steps is a hitch a reader sees, while a budget of two steps (the first default tried for
  the ITL, docs/adaptive.md "Defaults") disaggregated whenever decodes ran and lost up to
  0.36x goodput against collocated;
- MIN_STALL_S (1 s): below it a pause in streamed text reads as pacing, past it as a freeze
  (the 0.1 s / 1 s / 10 s response-time limits of interaction design). SmolLM2-135M
  decodes in ~8 ms a step on two quiet cores of the Xeon, so the floor binds, and its
  512-token chunk takes about 0.6 s on both (docs/adaptive.md): its local prefills fit, as
  on collocated. A 1B model's chunk takes seconds there: that is what the budget catches.

Until the model is usable there is no derived budget: with requests decoding the decision
takes the prompt-length fallback, as with an ITL target (a fresh deployment's first steps
froze two answers for 5.96 s on a loaded two-core host before it did), and with none, local.
"""

from __future__ import annotations

from typing import Any

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.model import OnlineCostModel

STALL_STEP_FACTOR = 10.0
MIN_STALL_S = 1.0
# Of the stall budget, what one step beside running decodes may take (the decode worker's
# StallGuard caps its local chunks to it; the decode group is sized so its step of the
# decodes alone fits it): under half, because a request whose KV lands from a prefill
# worker waits for the step in flight and then its own for its second token (at 0.75 those
# first gaps took 1.11-1.33 s under a 1 s budget while every running stream's stayed within
# 0.95 s).
STALL_HEADROOM = 0.45
# The least chunk a capped step takes, whatever the estimate: a prompt must progress, and
# below this a step's fixed cost dominates.
MIN_STALL_CHUNK_TOKENS = 16
UNLOADED_CONTEXT_TOKENS = 1024  # a short chat's context
# The TTFT budget without a target (decision.py's TTFT_BUDGET_FACTOR): priced per request.
TTFT_DERIVED = "per request: 3x what collocated would give it now"


def unloaded_step_s(model: OnlineCostModel, pool_size: int) -> float | None:
    """One decode step (UNLOADED_CONTEXT_TOKENS of context) on every core of the pool; None
    while the model cannot price it."""
    step = model.step_s("decode", pool_size, StepShape(0, 1, 0.0, UNLOADED_CONTEXT_TOKENS))
    return step if step is not None and step > 0 else None


def prefill_tokens_per_s(model: OnlineCostModel, pool_size: int, chunk_tokens: int) -> float | None:
    """Prompt tokens/s of full chunks alone on every core of the pool (None: not priced)."""
    shape = StepShape(chunk_tokens, 0, chunk_tokens * (chunk_tokens + 1) / 2, 0)
    step = model.step_s("prefill", pool_size, shape)
    return chunk_tokens / step if step else None


def stall_budget_on(config: AdaptiveConfig) -> bool:
    """A stall budget is in force: set, or to be derived (only 0 switches it off)."""
    return config.slo_max_gap_ms != 0


def max_gap_s(config: AdaptiveConfig, model: OnlineCostModel, pool_size: int) -> float | None:
    """The stall budget in seconds: the operator's (0: none), else derived (module
    docstring); None where there is none."""
    if config.slo_max_gap_ms is not None:
        return config.slo_max_gap_ms / 1000 if config.slo_max_gap_ms > 0 else None
    step = unloaded_step_s(model, pool_size)
    return None if step is None else max(STALL_STEP_FACTOR * step, MIN_STALL_S)


def enforced_gap_s(config: AdaptiveConfig, model: OnlineCostModel, pool_size: int) -> float | None:
    """The stall budget a decode worker holds a local prefill to (engine/stall_guard.py):
    `max_gap_s()`, or while it cannot be derived yet MIN_STALL_S, the least it can derive
    (a fresh worker's first prefills beside decodes are bounded too); None when off."""
    if not stall_budget_on(config):
        return None
    budget = max_gap_s(config, model, pool_size)
    return MIN_STALL_S if budget is None else budget


def describe(
    config: AdaptiveConfig, model: OnlineCostModel, pools: list[tuple[int, ...]]
) -> dict[str, Any]:
    """The targets for /v1/status: each one's value and whether it was set or derived, and,
    per pool of cores, what the derivation read."""
    gap = config.slo_max_gap_ms
    if gap is None:
        gap_source = "derived: max(10 x unloaded step, 1 s)"
    else:
        gap_source = "set" if gap > 0 else "off (set to 0)"
    rows = []
    for pool in pools:
        step = unloaded_step_s(model, len(pool))
        rate = prefill_tokens_per_s(model, len(pool), config.prefill_chunk_tokens)
        budget = max_gap_s(config, model, len(pool))
        rows.append(
            {
                "cpus": list(pool),
                "unloaded_step_ms": None if step is None else round(step * 1000, 2),
                "prefill_tokens_per_s": None if rate is None else round(rate, 1),
                # None while derived and the cost model cannot price a step yet.
                "max_gap_ms": None if budget is None else round(budget * 1000, 1),
            }
        )
    return {
        "ttft_ms": config.slo_ttft_ms,
        "ttft_source": "set" if config.slo_ttft_ms else TTFT_DERIVED,
        "itl_ms": config.slo_itl_ms,
        "itl_source": "set" if config.slo_itl_ms else "none",
        "max_gap_source": gap_source,
        "pools": rows,
    }
