"""A worker's own bound on how long a prefill may stall the decodes running beside it.

An adaptive deployment's planner prices a local prefill on the decode worker with its cost
model and sends the request with the stall budget (`Request.stall_budget_s`, set or derived:
pdserve/planner/targets.py). The planner's price can be wrong by seconds: it was measured on
other steps, a heartbeat ago, on the thread count the worker had before a core switch, and
other work on the host slows every step it did not see (a 219-token prompt priced at 0.44 s
on two threads ran as one 1.68 s step on one thread of a loaded host, a 1.68 s gap in every
stream there). So the worker bounds the step itself: while a request with a stall budget
prefills beside running decodes, the step's prefill tokens are capped at what this worker's
latest steps say fits HEADROOM of the budget.

    cap = (HEADROOM x budget - decode step) / seconds per prefill token

both measured here, per thread count, on the last steps (an exponential average: the host's
load moves within seconds). A thread count not seen yet is priced from the nearest one seen,
scaled by threads (half the threads, twice the time); before any prefill was measured the
cap is PROBE_TOKENS, a chunk small enough for any model this runs (its step then measures
the rate). Torch-free: the scheduler calls it (tests state it with given step times).
"""

from __future__ import annotations

from dataclasses import dataclass

# Of the budget, what a step's estimate may take: the estimate is the mean of the last
# steps, and the next one varies around it (15-30% on a shared two-core host).
HEADROOM = 0.75
# The first chunk beside decodes on a worker that never measured a prefill (its decodes all
# came by KV transfer): small, so the step that measures the rate stalls them little.
PROBE_TOKENS = 32
# The least chunk a capped step takes, whatever the estimate: a prompt must progress, and
# below this a step's fixed cost dominates (a decode step alone over budget is not the
# prefill's stall).
MIN_CHUNK_TOKENS = 16
# A step with fewer prefill tokens says little about the per-token rate (fixed costs).
MIN_MEASURED_TOKENS = 16
SMOOTHING = 0.5  # weight of the newest step in the averages


@dataclass
class _Rates:
    decode_s: float | None = None  # a step of decodes alone
    token_s: float | None = None  # one prefill token beside them (or alone)


class StallGuard:
    """Measured step times of one worker, per thread count; `cap()` turns a stall budget
    into the most prefill tokens a step beside running decodes may take."""

    def __init__(self) -> None:
        self._rates: dict[int, _Rates] = {}
        self.threads = 1  # the threads the next step runs on (the engine sets it)

    def observe(
        self, threads: int, num_prefill_tokens: int, num_decodes: int, seconds: float
    ) -> None:
        """A finished step: its thread count, its prefill tokens and decodes, its seconds."""
        rates = self._rates.setdefault(threads, _Rates())
        if num_prefill_tokens == 0:
            if num_decodes:
                rates.decode_s = _average(rates.decode_s, seconds)
            return
        if num_prefill_tokens < MIN_MEASURED_TOKENS:
            return
        # Beside decodes, their own step is not the prompt's; alone, the whole step is
        # charged to its tokens (an overestimate: the cap errs small).
        base = (self._scaled("decode_s", threads) or 0.0) if num_decodes else 0.0
        per_token = max(seconds - base, 0.0) / num_prefill_tokens
        rates.token_s = _average(rates.token_s, per_token)

    def cap(self, budget_s: float) -> int:
        """The most prefill tokens of a step beside running decodes on `threads` within
        HEADROOM of `budget_s`: at least MIN_CHUNK_TOKENS, PROBE_TOKENS before any rate."""
        decode_s = self._scaled("decode_s", self.threads)
        token_s = self._scaled("token_s", self.threads)
        if token_s is None or token_s <= 0:
            return PROBE_TOKENS
        room = HEADROOM * budget_s - (decode_s or 0.0)
        return max(MIN_CHUNK_TOKENS, int(room / token_s))

    def _scaled(self, name: str, threads: int) -> float | None:
        """`name`'s average on `threads`, else the nearest thread count's, scaled by threads."""
        have = {t: v for t, r in self._rates.items() if (v := getattr(r, name)) is not None}
        if not have:
            return None
        if threads in have:
            return have[threads]
        nearest = min(have, key=lambda t: (abs(t - threads), -t))
        return have[nearest] * nearest / max(1, threads)


def _average(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old
