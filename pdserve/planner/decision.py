"""Per request: prefill on a prefill worker and move the KV (remote), or on the decode worker
that will decode it (local). A pure function of what the router knows and the cost model
(docs/adaptive.md, "The decision"), so tests state it as a table and the simulator reuses it.

    no prefill worker                      -> local   no_prefill_worker
    nothing runs on the decode worker,     -> local   idle_decode   (no one to interfere with)
    and it has every core
    no ITL target and no usable model      -> local   no_itl_slo    (nothing to protect)
      (unless decodes run and a stall budget is on: the fallback below)
    no usable cost model yet               -> uncached prompt <= fallback_prompt_tokens ?
                                              local fallback_short : remote fallback_long
    local meets the ITL and TTFT budgets   -> local   fits_slo      (collocated's behaviour)
    remote meets both                      -> remote  itl_interference (local breaks the ITL)
                                                      | stall_budget (... the stall budget)
                                                      | ttft        (local breaks the TTFT)
    local in SLO-sized chunks meets both   -> local   slo_chunk     (stall-free, every core)
    none, least excess remote, but the     -> local in its SLO chunk when priced, else in
    prefill side backlogged (below)           stall-bounded chunks: remote_backlog
    none                                   -> the least summed relative excess over the
                                              budgets: least_violation (local or remote) |
                                              slo_chunk_least_violation

The stall budget (`slo_max_gap_s`, set or derived: targets.py) bounds the longest step a
running decode sees, as the ITL target does: the tighter of the two is the step budget, and
with nothing decoding it does not apply (no stream to stall).

Stall-bounded (`_beside_decodes`): a fallback to local beside running decodes whose full
chunks break the ITL, with no SLO-sized chunk priced, goes in the largest chunks whose step
stays within 1 / ITL_HEADROOM of the decodes' own step.

Backlogged: the prefill worker's queue alone (before this prompt's own prefill starts) takes
over TTFT_BUDGET_FACTOR times the local candidate's whole TTFT (the tolerance the default
TTFT budget gives collocated), or the KV a remote request reserves on the decode worker
(held while it waits in that queue) would leave fewer free tokens there than its running
decodes need (`decode_reserve_tokens`). Under overload the sum of relative excesses can
favour remote by its ITL alone; piling more onto such a queue only lengthens it and starves
the decodes of KV, so there the least violation stays local.

Local: the prompt runs in `chunk_tokens` chunks in the decode worker's steps, each step also
carrying its running decodes: those decodes' inter-token latency is that mixed step. Remote:
the prefill worker's queue and prompt (after its own cache hit), a core switch when it is
parked, and the exposed KV transfer; meanwhile the decode worker decodes on its share of the
host's cores (`decode_threads_split`), which is its inter-token latency. Local in SLO-sized
chunks (Sarathi-Serve's stall-free batching): the largest chunk whose step with the running
decodes fits ITL_HEADROOM of the ITL budget, sent with the request (`prefill_chunk_tokens`):
the decodes keep every core and their ITL, the prompt takes more, smaller steps. It comes
after remote: where a split meets both budgets, disaggregation is what pays (the prefill runs
in full chunks beside the decodes); it is the answer where no split can hold the ITL.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.model import OnlineCostModel

LOCAL, REMOTE = "local", "remote"
SLO_CHUNK = "slo_chunk"  # a candidate of decide(), not a kind: local with a smaller chunk
# Without an ITL target a local prefill breaks no budget: the operator asked for nothing a
# collocated worker cannot give, so local (every core, no transfer) decides unless the TTFT
# target says otherwise. A decode group is still sized (`decode_need`) for this many times
# the unloaded step when both groups are busy.
ITL_BUDGET_FACTOR = 2.0
ITL_HEADROOM = 0.75  # a decode group is sized for this share of the ITL budget
# Default TTFT budget: 3x what collocated would give the request now (its queue and prompt,
# with the running decodes, on every core); a remote prefill on half a pool takes ~2x.
TTFT_BUDGET_FACTOR = 3.0
# The smallest SLO-sized chunk: a one-token row is decode-sized and the scheduler does not
# cap it. Small chunks are not refused here: their TTFT (a step's fixed cost per few prompt
# tokens) is predicted and weighed like any other.
MIN_SLO_CHUNK_TOKENS = 2


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


@dataclass(frozen=True)
class Decision:
    kind: str  # LOCAL | REMOTE
    reason: str
    predictions: dict[str, float] = field(default_factory=dict)
    decode_id: str = ""
    prefill_id: str = ""
    num_prefill_tokens: int = 0  # uncached tokens the chosen worker computes
    prefill_chunk_tokens: int | None = None  # local in SLO-sized chunks: the chunk


def decide(
    s: Situation,
    model: OnlineCostModel,
    slo_ttft_s: float | None,
    slo_itl_s: float | None,
    fallback_prompt_tokens: int,
    slo_max_gap_s: float | None = None,
    stall_budget_on: bool = False,
) -> Decision:
    """`slo_max_gap_s`: the stall budget, None while there is none to apply; `stall_budget_on`:
    one is in force (set, or derived once the model can price a step), so before the model is
    usable the prompt-length fallback keeps long prompts off a worker with running decodes."""
    local_tokens = max(1, s.num_prompt_tokens - s.num_cached_decode_tokens)
    remote_tokens = max(1, s.num_prompt_tokens - s.num_cached_prefill_tokens)
    local = Decision(LOCAL, "", num_prefill_tokens=local_tokens)
    remote = Decision(REMOTE, "", num_prefill_tokens=remote_tokens)
    if not s.has_prefill:
        return _as(local, "no_prefill_worker")
    # Under a held split (cores.py) the idle decode worker has only its share: its prompt's
    # chunk steps are what decodes joining it wait, while the prefill worker idles on the
    # rest, with no switch to pay. That is priced like any other situation.
    idle = s.num_decodes == 0 and s.decode_queue_tokens == 0
    if idle and s.decode_threads_local >= s.pool_size:
        return _as(local, "idle_decode")
    gap_s = slo_max_gap_s if s.num_decodes else None  # no stream running: none to stall
    stall_bound = gap_s is not None and (slo_itl_s is None or gap_s < slo_itl_s)
    slo_itl_s = gap_s if stall_bound else slo_itl_s  # the step budget: the tighter one
    p = predict(s, model, slo_ttft_s, slo_itl_s)
    if p is None:
        if slo_itl_s is None and not (stall_budget_on and s.num_decodes):
            return _as(local, "no_itl_slo")
        if local_tokens <= fallback_prompt_tokens:
            return _as(local, "fallback_short")
        return _as(remote, "fallback_long")
    chunked = dataclasses.replace(local, prefill_chunk_tokens=int(p.get("slo_chunk_tokens", 0)))
    kinds = (LOCAL, SLO_CHUNK, REMOTE) if "slo_chunk_tokens" in p else (LOCAL, REMOTE)
    # Predictions are mean steps and the target a tail: every path gets the headroom the
    # SLO-sized chunk and the decode group are sized with.
    itl_budget_s = ITL_HEADROOM * p["itl_budget_s"]
    itl_ok = {k: p[f"itl_{k}_s"] <= itl_budget_s for k in kinds}
    ttft_ok = {k: p[f"ttft_{k}_s"] <= p["ttft_budget_s"] for k in kinds}
    if stall_bound:  # which budget the ITL predictions were held to, for /v1/status
        p["stall_budget_s"] = p["itl_budget_s"]
    if itl_ok[LOCAL] and ttft_ok[LOCAL]:
        return _as(local, "fits_slo", p)
    if itl_ok[REMOTE] and ttft_ok[REMOTE]:
        broken = "stall_budget" if stall_bound else "itl_interference"
        return _as(remote, "ttft" if itl_ok[LOCAL] else broken, p)
    if SLO_CHUNK in kinds and itl_ok[SLO_CHUNK] and ttft_ok[SLO_CHUNK]:
        return _as(chunked, "slo_chunk", p)

    def excess(kind: str) -> float:
        budgets = {"itl": itl_budget_s, "ttft": p["ttft_budget_s"]}
        return sum(max(0.0, p[f"{m}_{kind}_s"] / max(budgets[m], 1e-9) - 1) for m in budgets)

    best = min(kinds, key=excess)  # ties: the first, local before remote
    if best == REMOTE:
        nearest = min((k for k in kinds if k != REMOTE), key=excess)
        queued = p["queue_remote_s"] > TTFT_BUDGET_FACTOR * p[f"ttft_{nearest}_s"]
        free = s.decode_free_tokens
        starves = free is not None and free - local_tokens < s.decode_reserve_tokens
        if queued or starves:  # a backlog's requests must not stall the running decodes
            if chunked.prefill_chunk_tokens:
                return _as(chunked, "remote_backlog", p)
            return _beside_decodes(s, model, local, "remote_backlog", p, itl_budget_s)
    if best == SLO_CHUNK:
        return _as(chunked, "slo_chunk_least_violation", p)
    if best == LOCAL and not chunked.prefill_chunk_tokens:
        return _beside_decodes(s, model, local, "least_violation", p, itl_budget_s)
    return _as(local if best == LOCAL else remote, "least_violation", p)


def _beside_decodes(
    s: Situation,
    model: OnlineCostModel,
    local: Decision,
    reason: str,
    p: dict[str, float],
    itl_budget_s: float,
) -> Decision:
    """Local as a fallback (`remote_backlog`, `least_violation`) with no SLO-sized chunk
    priced: where full chunks would break the ITL of running decodes, in the largest chunks
    whose step, at the prompt's end, stays within 1 / ITL_HEADROOM of the decodes' own step.
    A fallback must not stall the streams already running: a full chunk on a one-core decode
    group is 0.5-1 s per 256 tokens, and queued prompts share a step."""
    if s.num_decodes and p["itl_local_s"] > itl_budget_s:
        shape = StepShape(0, s.num_decodes, 0, s.decode_context_tokens)
        alone = model.step_s("decode", s.decode_threads_local, shape)
        bound = predict_slo_chunk(s, model, local.num_prefill_tokens, (alone or 0) / ITL_HEADROOM)
        if bound:
            p = {**p, "stall_chunk_tokens": bound["slo_chunk_tokens"],
                 "ttft_stall_chunk_s": bound["ttft_slo_chunk_s"],
                 "itl_stall_chunk_s": bound["itl_slo_chunk_s"]}  # fmt: skip
            local = dataclasses.replace(local, prefill_chunk_tokens=int(bound["slo_chunk_tokens"]))
    return _as(local, reason, p)


def predict(
    s: Situation, model: OnlineCostModel, slo_ttft_s: float | None, slo_itl_s: float | None
) -> dict[str, float] | None:
    """Predicted TTFT and ITL of both paths and the budgets; None without a usable model.
    A remote request's own first gap waits for the exposed transfer: it counts in its ITL.
    Queued prompts share the steps the request runs in (the scheduler batches them), so a
    queue costs its tokens' compute, not steps of its own."""
    local_tokens = max(1, s.num_prompt_tokens - s.num_cached_decode_tokens)
    remote_tokens = max(1, s.num_prompt_tokens - s.num_cached_prefill_tokens)
    b, ctx, chunk = s.num_decodes, s.decode_context_tokens, max(1, s.chunk_tokens)
    t_local, t_pool, cached_local = s.decode_threads_local, s.pool_size, s.num_cached_decode_tokens
    parts = (
        model.step_s("decode", t_pool, StepShape(0, max(b, 1), 0, ctx)),
        queue_s(model, "decode", t_pool, s.decode_queue_tokens, chunk, b, ctx),
        prefill_s(model, "decode", t_pool, local_tokens, cached_local, chunk, b, ctx),
        queue_s(model, "decode", t_local, s.decode_queue_tokens, chunk, b, ctx),
        prefill_s(model, "decode", t_local, local_tokens, cached_local, chunk, b, ctx),
        queue_s(model, "prefill", s.prefill_threads, s.prefill_queue_tokens, chunk),
        prefill_s(
            model, "prefill", s.prefill_threads, remote_tokens, s.num_cached_prefill_tokens, chunk
        ),
        model.step_s("decode", s.decode_threads_split, StepShape(0, b, 0, ctx)),
    )
    if any(p is None for p in parts):
        return None
    unloaded, queue_pool, on_pool, queue_local, mixed, queue_remote, remote, split = parts  # type: ignore[misc]
    if not unloaded > 0:  # a fit that prices a decode step at nothing cannot set a budget
        return None
    transfer = model.transfer_s(local_tokens * s.kv_bytes_per_token)
    collocated = queue_pool + on_pool[0]  # what one worker on every core would give it now
    p = {
        "ttft_local_s": queue_local + mixed[0],
        "itl_local_s": max(mixed[1], unloaded),
        "ttft_remote_s": (s.switch_s if s.prefill_parked else 0.0) + queue_remote + remote[0],
        "itl_remote_s": split + transfer,
        "transfer_s": transfer,
        "queue_remote_s": queue_remote,
        "itl_budget_s": slo_itl_s if slo_itl_s is not None else math.inf,
        "ttft_budget_s": slo_ttft_s if slo_ttft_s is not None else TTFT_BUDGET_FACTOR * collocated,
    }
    if slo_itl_s is not None and p["itl_local_s"] > slo_itl_s:
        p.update(predict_slo_chunk(s, model, local_tokens, ITL_HEADROOM * slo_itl_s))
    return p


def predict_slo_chunk(
    s: Situation, model: OnlineCostModel, num_tokens: int, step_budget_s: float
) -> dict[str, float]:
    """The largest chunk below `chunk_tokens` whose step with the running decodes, at the
    prompt's end (its costliest chunk: the most attention), fits `step_budget_s`, and the
    local prefill's TTFT and ITL in such chunks; {} when no chunk of MIN_SLO_CHUNK_TOKENS
    does. Queued prompts are priced in the same chunks, in steps of their own: on a worker
    that takes SLO-sized chunks the queue is most likely capped too."""
    b, ctx, threads = s.num_decodes, s.decode_context_tokens, s.decode_threads_local
    end = s.num_cached_decode_tokens + num_tokens

    def step(n: int) -> float:
        seconds = model.step_s("decode", threads, StepShape(n, b, n * (end - n + (n + 1) / 2), ctx))
        return math.inf if seconds is None else seconds

    lo, hi = MIN_SLO_CHUNK_TOKENS, min(s.chunk_tokens, num_tokens) - 1
    if hi < lo or step(lo) > step_budget_s:
        return {}
    while lo < hi:  # the step grows with the chunk: the largest that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step(mid) <= step_budget_s else (lo, mid - 1)
    own = prefill_s(model, "decode", threads, num_tokens, s.num_cached_decode_tokens, lo, b, ctx)
    queue = prefill_s(model, "decode", threads, s.decode_queue_tokens, 0, lo, b, ctx)
    if own is None or queue is None:
        return {}
    return {
        "slo_chunk_tokens": float(lo),
        "ttft_slo_chunk_s": queue[0] + own[0],
        "itl_slo_chunk_s": max(own[1], queue[1]),
    }


def decode_need(
    model: OnlineCostModel,
    pool: int,
    num_decodes: int,
    context_tokens: int,
    slo_itl_s: float | None,
) -> int:
    """The fewest threads whose decode step of these decodes stays within ITL_HEADROOM of the
    ITL budget (0: no usable model; `pool` when none does). The headroom leaves room for the
    requests the batch admits before the planner looks again."""
    if num_decodes <= 0:
        return 1
    shape = StepShape(0, num_decodes, 0, context_tokens)
    unloaded = model.step_s("decode", pool, shape)
    if unloaded is None:
        return 0
    budget = ITL_HEADROOM * (slo_itl_s if slo_itl_s is not None else ITL_BUDGET_FACTOR * unloaded)
    for threads in range(1, pool + 1):
        step = model.step_s("decode", threads, shape)
        if step is not None and step <= budget:
            return threads
    return pool


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
    compute, as independent prompts of at most a chunk each (None without a usable model)."""
    if num_tokens <= 0:
        return 0.0
    n = min(chunk_tokens, num_tokens)
    base = StepShape(1, num_decodes, 1.0, context_tokens)
    queued = StepShape(1 + num_tokens, num_decodes, 1.0 + num_tokens * (n + 1) / 2, context_tokens)
    with_queue, without = model.step_s(role, threads, queued), model.step_s(role, threads, base)
    if with_queue is None or without is None:
        return None
    return max(0.0, with_queue - without)


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
        return model.step_s(role, threads, StepShape(n, num_decodes, n * (done + (n + 1) / 2),
                                                     context_tokens))  # fmt: skip

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


def _as(decision: Decision, reason: str, predictions: dict[str, float] | None = None) -> Decision:
    return dataclasses.replace(decision, reason=reason, predictions=predictions or {})
