"""A worker's own bound on how long a prefill may stall the decodes running beside it.

An adaptive deployment's planner prices a local prefill on the decode worker with its cost
model and sends the request with the stall budget (`Request.stall_budget_s`, set or derived:
pdserve/planner/targets.py). The planner's price can be wrong by seconds: it was measured on
other steps, a heartbeat ago, on the thread count the worker had before a core switch, and
other work on the host slows every step it did not see (a 219-token prompt priced at 0.44 s
on two threads ran as one 1.68 s step on one thread of a loaded host, a 1.68 s gap in every
stream there). So the worker bounds the step itself: while a request with a stall budget
prefills beside running decodes, the step's prefill tokens are capped at what this worker's
latest steps say fits HEADROOM of the budget:

    cap = (HEADROOM x budget - decode step) / (a prompt token's seconds
                                               + DEVIATIONS x their mean deviation)

at least MIN_CHUNK_TOKENS, so the prompt progresses, where those fit the whole budget beside
the decode step, else as many as do (at least LEAST_CHUNK_TOKENS); all measured here, per
thread count, as TCP estimates a round trip and its variation (RFC 6298): exponential
averages follow a host whose load moves within seconds, and the deviation term shrinks
the chunk where steps of one shape vary (a 57-token step beside 8 decodes took 0.43-1.10 s
on one thread of a two-core host at a load of 10). The decode step is the one this step
runs: averaged per number of decodes (one AVX2 core runs 7 decodes of a 1B model in 0.34 s
and 16 in 0.8 s, so one mean over both is wrong by a third of the budget at either end),
an unseen number priced from the nearest seen, scaled by decodes, plus DEVIATIONS x the
decode steps' mean deviation from their own number's average. A thread count not run yet
is priced from the nearest one run, scaled by threads (half the threads, twice the time);
before any prefill was measured the cap is PROBE_TOKENS. Torch-free: the scheduler calls it
(tests state it with given step times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.pricing import MIN_SLO_CHUNK_TOKENS
from pdserve.planner.targets import MIN_STALL_CHUNK_TOKENS, STALL_HEADROOM

# Of the budget, what a step's estimate may take, and the least chunk a capped step takes
# where the decode step leaves less (the planner sizes the decode group by the same two:
# planner/targets.py) — but never past the whole budget by this worker's own estimate: there
# it takes what fits, at least LEAST_CHUNK_TOKENS. On one AVX2 core a 1B batch of 9-12
# decodes steps in 0.55-0.6 s and sixteen prompt tokens add 0.45 s: the least chunk alone
# took those steps to 1.0-1.09 s under a 1 s budget, a gap in every stream there.
HEADROOM = STALL_HEADROOM
MIN_CHUNK_TOKENS = MIN_STALL_CHUNK_TOKENS
LEAST_CHUNK_TOKENS = MIN_SLO_CHUNK_TOKENS  # a one-token row is a decode the scheduler won't cap
DEVIATIONS = 2.0  # mean deviations of a prompt token's time added to its mean
# The first chunk beside decodes on a worker that never measured a prefill (its decodes all
# came by KV transfer): small, so the step that measures the rate stalls them little.
PROBE_TOKENS = 32
# A step with fewer prefill tokens says little about the per-token rate (fixed costs).
MIN_MEASURED_TOKENS = 16
SMOOTHING = 0.25  # weight of the newest step in the averages (RFC 6298: 1/8 and 1/4)


@dataclass
class _Rates:
    decode_s: dict[int, float] = field(default_factory=dict)  # a step of n decodes alone, by n
    decode_dev_s: float = 0.0  # decode steps' mean deviation from their number's average
    token_s: float | None = None  # one prefill token beside them (or alone)
    token_dev_s: float | None = None  # its mean deviation

    def decode_step_s(self, num_decodes: int) -> float | None:
        """A step of `num_decodes` alone: its average, else the nearest number's, scaled."""
        if not self.decode_s or num_decodes <= 0:
            return None
        n = min(self.decode_s, key=lambda k: (abs(k - num_decodes), -k))
        return self.decode_s[n] * num_decodes / n


class StallGuard:
    """Measured step times of one worker, per thread count; `cap()` turns a stall budget
    into the most prefill tokens a step beside running decodes may take."""

    def __init__(self) -> None:
        self._rates: dict[int, _Rates] = {}
        self.threads = 1  # the threads the next step runs on (the engine sets it)
        # What the worker reports (Stats, `fields()`): the budget and cap of the last cap
        # asked, and the steps whose prefill tokens reached the least cap given for them.
        self.budget_s: float | None = None
        self.cap_tokens: int | None = None
        self.num_capped_steps = 0
        self._step_cap: int | None = None  # the least cap given since the last step

    def fields(self) -> dict[str, float | int | None]:
        """The guard in the worker's Stats (`/v1/status`, `pdserve_stall_capped_steps_total`)."""
        return {
            "stall_budget_s": self.budget_s,
            "stall_cap_tokens": self.cap_tokens,
            "num_stall_capped_steps": self.num_capped_steps,
        }

    def observe(
        self, threads: int, num_prefill_tokens: int, num_decodes: int, seconds: float
    ) -> None:
        """A finished step: its thread count, its prefill tokens and decodes, its seconds."""
        if self._step_cap is not None and num_prefill_tokens >= self._step_cap:
            self.num_capped_steps += 1
        self._step_cap = None
        rates = self._rates.setdefault(threads, _Rates())
        if num_prefill_tokens == 0:
            if num_decodes:
                seen = rates.decode_step_s(num_decodes)
                if seen is not None:
                    rates.decode_dev_s = _average(rates.decode_dev_s, abs(seconds - seen))
                average = _average(rates.decode_s.get(num_decodes), seconds)
                rates.decode_s[num_decodes] = average
            return
        if num_prefill_tokens < MIN_MEASURED_TOKENS:
            return
        # Beside decodes, their own step is not the prompt's; alone, the whole step is
        # charged to its tokens (an overestimate: the cap errs small).
        base = self._decode_s(threads, num_decodes)
        per_token = max(seconds - base, 0.0) / num_prefill_tokens
        if rates.token_s is None:  # RFC 6298's first sample: half of it as the deviation
            rates.token_s, rates.token_dev_s = per_token, per_token / 2
            return
        rates.token_dev_s = _average(rates.token_dev_s, abs(rates.token_s - per_token))
        rates.token_s = _average(rates.token_s, per_token)

    def cap(self, budget_s: float, num_decodes: int) -> int:
        """The most prefill tokens of a step beside `num_decodes` running decodes on `threads`
        within HEADROOM of `budget_s`; at least MIN_CHUNK_TOKENS where they fit the whole
        budget, else what does, at least LEAST_CHUNK_TOKENS; PROBE_TOKENS before any rate."""
        tokens = self._cap(budget_s, num_decodes)
        self.budget_s, self.cap_tokens = budget_s, tokens
        self._step_cap = tokens if self._step_cap is None else min(self._step_cap, tokens)
        return tokens

    def _cap(self, budget_s: float, num_decodes: int) -> int:
        decode_s = self._decode_s(self.threads, num_decodes, DEVIATIONS)
        token_s = self._scaled("token_s", self.threads)
        if token_s is None or token_s <= 0:
            return PROBE_TOKENS
        token_s += DEVIATIONS * (self._scaled("token_dev_s", self.threads) or 0.0)
        tokens = int((HEADROOM * budget_s - decode_s) / token_s)
        if tokens >= MIN_CHUNK_TOKENS:
            return tokens
        whole = int((budget_s - decode_s) / token_s)  # what fits the whole budget
        return max(LEAST_CHUNK_TOKENS, min(MIN_CHUNK_TOKENS, whole))

    def _decode_s(self, threads: int, num_decodes: int, deviations: float = 0.0) -> float:
        """A step of `num_decodes` alone on `threads`, plus `deviations` x its mean deviation;
        0 with none measured (a worker whose decodes all came by KV transfer)."""
        thread_counts = [t for t, r in self._rates.items() if r.decode_s]
        if not thread_counts or num_decodes <= 0:
            return 0.0
        nearest = min(thread_counts, key=lambda t: (abs(t - threads), -t))
        rates = self._rates[nearest]
        step_s = rates.decode_step_s(num_decodes) or 0.0
        return (step_s + deviations * rates.decode_dev_s) * nearest / max(1, threads)

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
