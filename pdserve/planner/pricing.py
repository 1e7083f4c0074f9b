"""What each way to prefill a request would cost: the candidates decide()
(pdserve/planner/decision.py, whose docstring says how each path is priced) chooses among,
each a `Candidate` with its predicted TTFT and the ITL it leaves running decodes, priced from
the online cost model, and the one scoring rule that ranks them (`Candidate.excess`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.model import OnlineCostModel

LOCAL, REMOTE = "local", "remote"
# Candidates of decide(), not kinds: local with a smaller chunk (SLO-sized, or stall-bounded)
SLO_CHUNK, STALL_CHUNK = "slo_chunk", "stall_chunk"
ITL_HEADROOM = 0.75  # a decode group is sized for this share of the ITL budget
# Default TTFT budget: 3x what collocated would give the request now (its queue and prompt,
# with the running decodes, on every core); a remote prefill on half a pool takes ~2x.
TTFT_BUDGET_FACTOR = 3.0
# The smallest SLO-sized chunk: a one-token row is decode-sized and the scheduler does not
# cap it. Small chunks are not refused here: their TTFT (a step's fixed cost per few prompt
# tokens) is predicted and weighed like any other.
MIN_SLO_CHUNK_TOKENS = 2
# The decode steps a remote request's first gap spans under the stall budget (`predict`).
REMOTE_FIRST_GAP_STEPS = 2


@dataclass(frozen=True)
class Situation:
    """The request and its two candidate workers as the router sees them now."""

    num_prompt_tokens: int
    num_cached_decode_tokens: int  # prefix the candidate decode worker caches
    num_cached_prefill_tokens: int  # prefix the candidate prefill worker caches
    pool_size: int  # cores of the decode worker's host
    num_decodes: int  # requests decoding on the decode worker
    decode_context_tokens: int  # the KV they attend
    decode_queue_tokens: int  # local prefill tokens already queued there
    decode_threads_local: int  # the decode worker's threads if it prefills this locally
    decode_threads_split: int  # ... while a remote prefill runs beside it (same host)
    prefill_threads: int  # the prefill worker's threads for this prefill
    prefill_queue_tokens: int
    prefill_parked: bool  # the prefill worker has no cores yet: a core switch first
    switch_s: float  # measured core switch latency
    kv_bytes_per_token: float
    chunk_tokens: int
    has_prefill: bool = True
    decode_free_tokens: int | None = None  # free KV on the decode worker (None: unknown)
    decode_reserve_tokens: int = 0  # free KV its running decodes need to keep growing
    # No split of the decode worker's host holds the stall budget (decision.DecodeNeed).
    split_breaks_stall: bool = False


@dataclass(frozen=True)
class Candidate:
    """One way to prefill the request, priced: its path (LOCAL, SLO_CHUNK, REMOTE, or
    STALL_CHUNK: local in stall-bounded chunks), the chunk it runs in when not the worker's
    own, its predicted time to first token, and the inter-token latency it leaves the
    running decodes (remote: the split's decode step plus the request's exposed transfer)."""

    path: str
    ttft_s: float
    itl_s: float
    chunk_tokens: int | None = None

    def meets(self, budgets: Budgets) -> bool:
        return self.itl_s <= budgets.itl_s and self.ttft_s <= budgets.ttft_s

    def excess(self, budgets: Budgets) -> float:
        """The one scoring rule: the summed relative excess over the budgets (0: meets
        both). Where no candidate meets both, the least excess is the least violation."""
        itl = max(0.0, self.itl_s / max(budgets.itl_s, 1e-9) - 1)
        return itl + max(0.0, self.ttft_s / max(budgets.ttft_s, 1e-9) - 1)


@dataclass(frozen=True)
class Budgets:
    ttft_s: float
    # Predictions are mean steps and the target a tail: every path is held to the headroom
    # the SLO-sized chunk and the decode group are sized with (ITL_HEADROOM of the target).
    itl_s: float


@dataclass(frozen=True)
class Prediction:
    """Every candidate of one request, priced, and the budgets they are held to."""

    local: Candidate
    remote: Candidate
    slo_chunk: Candidate | None  # priced where full chunks break the ITL target
    transfer_s: float  # the remote path's exposed KV transfer
    queue_remote_s: float  # the prefill worker's queue ahead of it
    itl_budget_s: float  # the step budget (the ITL target or the stall budget; inf: none)
    ttft_budget_s: float
    stall_budget_s: float | None = None  # the step budget, when the stall budget is it
    stall_chunk: Candidate | None = None  # a fallback beside decodes, `_beside_decodes`
    # What a remote prefill's split adds to the prompts queued on the decode worker: they
    # prefill on its split share instead of local's threads (0: no queue, or no split).
    split_delay_s: float = 0.0
    # The queues priced, in prompt tokens as the router counts them (Stats + its own charges)
    queue_remote_tokens: int = 0
    queue_local_tokens: int = 0

    @property
    def budgets(self) -> Budgets:
        return Budgets(self.ttft_budget_s, ITL_HEADROOM * self.itl_budget_s)

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """decide()'s choices, in the order ties go: local, its SLO-sized chunk, remote."""
        return tuple(c for c in (self.local, self.slo_chunk, self.remote) if c is not None)

    def as_dict(self) -> dict[str, float]:
        """Flat, for /v1/status and the log: ttft_<path>_s, itl_<path>_s, <path>_tokens of a
        chunked candidate, and the budgets."""
        out: dict[str, float] = {}
        for c in (self.local, self.remote, self.slo_chunk, self.stall_chunk):
            if c is not None:
                if c.chunk_tokens is not None:
                    out[f"{c.path}_tokens"] = float(c.chunk_tokens)
                out[f"ttft_{c.path}_s"], out[f"itl_{c.path}_s"] = c.ttft_s, c.itl_s
        out["transfer_s"], out["queue_remote_s"] = self.transfer_s, self.queue_remote_s
        out["split_delay_s"] = self.split_delay_s
        out["queue_remote_tokens"] = float(self.queue_remote_tokens)
        out["queue_local_tokens"] = float(self.queue_local_tokens)
        out["itl_budget_s"], out["ttft_budget_s"] = self.itl_budget_s, self.ttft_budget_s
        if self.stall_budget_s is not None:
            out["stall_budget_s"] = self.stall_budget_s
        return out


class _Unpriced(Exception):
    """The cost model cannot price a step yet (too few samples of its role and threads)."""


def _priced(seconds: float | None) -> float:
    if seconds is None:
        raise _Unpriced
    return seconds


def predict(
    s: Situation,
    model: OnlineCostModel,
    slo_ttft_s: float | None,
    slo_itl_s: float | None,
    stall_bound: bool = False,
) -> Prediction | None:
    """Every candidate priced, and the budgets; None without a usable model.
    A remote request's own first gap waits for the exposed transfer: it counts in its ITL.
    Under the stall budget (`stall_bound`: it is the step budget) that gap is its longest
    one, and it spans two of the split's decode steps too: the one in flight when its KV
    lands, then its own. Queued prompts share the steps the request runs in (the scheduler
    batches them), so a queue costs its tokens' compute, not steps of its own."""
    local_tokens = max(1, s.num_prompt_tokens - s.num_cached_decode_tokens)
    remote_tokens = max(1, s.num_prompt_tokens - s.num_cached_prefill_tokens)
    b, ctx, chunk = s.num_decodes, s.decode_context_tokens, max(1, s.chunk_tokens)
    t_local, t_pool, cached_local = s.decode_threads_local, s.pool_size, s.num_cached_decode_tokens

    def prefill(role: str, threads: int, tokens: int, cached: int, with_decodes: bool):
        decodes, context = (b, ctx) if with_decodes else (0, 0)
        seconds = prefill_s(model, role, threads, tokens, cached, chunk, decodes, context)
        if seconds is None:
            raise _Unpriced
        return seconds

    def queue(role: str, threads: int, tokens: int, with_decodes: bool) -> float:
        decodes, context = (b, ctx) if with_decodes else (0, 0)
        return _priced(queue_s(model, role, threads, tokens, chunk, decodes, context))

    try:
        unloaded = _priced(model.step_s("decode", t_pool, StepShape(0, max(b, 1), 0, ctx)))
        queue_pool = queue("decode", t_pool, s.decode_queue_tokens, True)
        on_pool = prefill("decode", t_pool, local_tokens, cached_local, True)
        queue_local = queue("decode", t_local, s.decode_queue_tokens, True)
        mixed = prefill("decode", t_local, local_tokens, cached_local, True)
        queue_remote = queue("prefill", s.prefill_threads, s.prefill_queue_tokens, False)
        cached_remote = s.num_cached_prefill_tokens
        own_remote = prefill("prefill", s.prefill_threads, remote_tokens, cached_remote, False)
        split = _priced(model.step_s("decode", s.decode_threads_split, StepShape(0, b, 0, ctx)))
        queue_split = queue("decode", s.decode_threads_split, s.decode_queue_tokens, True)
    except _Unpriced:
        return None
    if not unloaded > 0:  # a fit that prices a decode step at nothing cannot set a budget
        return None
    # Layer-wise sends (the default mode) run during the remote prefill; in full mode the
    # fit of exposed times, from the third transfer on, prices the rest.
    transfer = model.transfer_s(local_tokens * s.kv_bytes_per_token, overlap_s=own_remote[0])
    collocated = queue_pool + on_pool[0]  # what one worker on every core would give it now
    switch_s = s.switch_s if s.prefill_parked else 0.0
    local = Candidate(LOCAL, queue_local + mixed[0], max(mixed[1], unloaded))
    slo_chunk = None
    if slo_itl_s is not None and local.itl_s > slo_itl_s:
        slo_chunk = predict_slo_chunk(s, model, local_tokens, ITL_HEADROOM * slo_itl_s)
    return Prediction(
        local=local,
        remote=Candidate(
            REMOTE,
            switch_s + queue_remote + own_remote[0],
            (REMOTE_FIRST_GAP_STEPS if stall_bound else 1) * split + transfer,
        ),
        slo_chunk=slo_chunk,
        transfer_s=transfer,
        queue_remote_s=queue_remote,
        split_delay_s=max(0.0, queue_split - queue_local),
        queue_remote_tokens=s.prefill_queue_tokens,
        queue_local_tokens=s.decode_queue_tokens,
        itl_budget_s=slo_itl_s if slo_itl_s is not None else math.inf,
        ttft_budget_s=slo_ttft_s if slo_ttft_s is not None else TTFT_BUDGET_FACTOR * collocated,
    )


def predict_slo_chunk(
    s: Situation,
    model: OnlineCostModel,
    num_tokens: int,
    step_budget_s: float,
    path: str = SLO_CHUNK,
) -> Candidate | None:
    """The largest chunk below `chunk_tokens` whose step with the running decodes, at the
    prompt's end (its costliest chunk: the most attention), fits `step_budget_s`, and the
    local prefill's TTFT and ITL in such chunks; None when no chunk of MIN_SLO_CHUNK_TOKENS
    does. Queued prompts are priced in the same chunks, in steps of their own: on a worker
    that takes SLO-sized chunks the queue is most likely capped too."""
    b, ctx, threads = s.num_decodes, s.decode_context_tokens, s.decode_threads_local
    end = s.num_cached_decode_tokens + num_tokens

    def step(n: int) -> float:
        seconds = model.step_s("decode", threads, StepShape(n, b, n * (end - n + (n + 1) / 2), ctx))
        return math.inf if seconds is None else seconds

    lo, hi = MIN_SLO_CHUNK_TOKENS, min(s.chunk_tokens, num_tokens) - 1
    if hi < lo or step(lo) > step_budget_s:
        return None
    while lo < hi:  # the step grows with the chunk: the largest that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step(mid) <= step_budget_s else (lo, mid - 1)
    own = prefill_s(model, "decode", threads, num_tokens, s.num_cached_decode_tokens, lo, b, ctx)
    queue = prefill_s(model, "decode", threads, s.decode_queue_tokens, 0, lo, b, ctx)
    if own is None or queue is None:
        return None
    return Candidate(path, queue[0] + own[0], max(own[1], queue[1]), chunk_tokens=lo)


def queue_s(
    model: OnlineCostModel,
    role: str,
    threads: int,
    num_tokens: int,
    chunk_tokens: int,
    num_decodes: int = 0,
    context_tokens: int = 0,
) -> float | None:
    """What `num_tokens` of queued prompts add to the steps they share with this one: their
    compute, as independent prompts of at most a chunk each (None without a usable model):
    what one chunk of them adds to a step, times the chunks they make. Priced on a step the
    size of a chunk, as the worker runs it: a step of the whole queue at once (thousands of
    tokens) is none a worker ran, and the model prices only the steps its samples span."""
    if num_tokens <= 0:
        return 0.0
    n = min(chunk_tokens, num_tokens)
    base = StepShape(1, num_decodes, 1.0, context_tokens)
    queued = StepShape(1 + n, num_decodes, 1.0 + n * (n + 1) / 2, context_tokens)
    with_queue, without = model.step_s(role, threads, queued), model.step_s(role, threads, base)
    if with_queue is None or without is None:
        return None
    return max(0.0, with_queue - without) * num_tokens / n


def prefill_s(
    model: OnlineCostModel,
    role: str,
    threads: int,
    num_tokens: int,
    num_cached: int,
    chunk_tokens: int,
    num_decodes: int = 0,
    context_tokens: int = 0,
) -> tuple[float, float] | None:
    """(seconds, longest step) to prefill `num_tokens` after `num_cached` in chunks, each step
    also carrying `num_decodes` decodes over `context_tokens`; None without a usable model.

    In closed form, not chunk by chunk: the router decides on its event loop, and a 2,000-token
    prompt in SLO-sized chunks of 2 is a thousand steps (priced one by one, 0.8 s of a loaded
    core that every stream waited for). The full chunks differ only in their attention pairs,
    in which the model is linear: their sum is as many steps at the mean pairs; the longest is
    the last full chunk or the remainder after it (each attends more than any before)."""
    if num_tokens <= 0:
        return 0.0, 0.0

    def step(n: int, done: float) -> float | None:
        return model.step_s(
            role, threads, StepShape(n, num_decodes, n * (done + (n + 1) / 2), context_tokens)
        )

    num_full, rest = divmod(num_tokens, chunk_tokens)
    total = longest = 0.0
    if num_full:
        mean = step(chunk_tokens, num_cached + (num_full - 1) * chunk_tokens / 2)
        last = step(chunk_tokens, num_cached + (num_full - 1) * chunk_tokens)
        if mean is None or last is None:
            return None
        total, longest = num_full * mean, last
    if rest:
        tail = step(rest, num_cached + num_full * chunk_tokens)
        if tail is None:
            return None
        total, longest = total + tail, max(longest, tail)
    return total, longest
