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
    decodes run, and no split of the host  -> local   stall_split   (in its SLO chunk when
      holds the stall budget (below)                                priced, else stall-bounded)
    remote meets both, but behind a queue  -> local   prefill_queue (in its SLO chunk)
      (the prefill worker's, or the decode
      worker's that its split slows), and
      local in SLO-sized chunks meets both
      sooner
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

No split holds it (`Situation.split_breaks_stall`, from `decode_need()`): the decode group's
step of its decodes alone fits ITL_HEADROOM of the budget, the share every prediction is held
to, only on every core of the host (a 1B Q4_1 batch of three at 1.1 s a step on one core of
two, under a 1 s budget). A remote prefill would take a core from those decodes and freeze
every running stream, so it is not a candidate: the prompt prefills locally, beside the
decodes on every core, in chunks the worker's StallGuard caps; the core plan (cores.py)
keeps the pool with the decode group for the same reason. Where a split does hold them, a
remote request's own first gap is priced at two of its steps (pricing.predict) and weighed
like any other excess: that costs the newcomer alone, so it competes on TTFT with local.

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
from dataclasses import dataclass

from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.pricing import (
    ITL_HEADROOM,
    LOCAL,
    REMOTE,
    SLO_CHUNK,
    STALL_CHUNK,
    TTFT_BUDGET_FACTOR,
    Budgets,
    Prediction,
    Situation,
    predict,
    predict_slo_chunk,
)

# Without an ITL target a local prefill breaks no budget: the operator asked for nothing a
# collocated worker cannot give, so local (every core, no transfer) decides unless the TTFT
# target says otherwise. A decode group is still sized (`decode_need`) for this many times
# the unloaded step when both groups are busy.
ITL_BUDGET_FACTOR = 2.0


@dataclass(frozen=True)
class Decision:
    kind: str  # LOCAL | REMOTE
    reason: str
    prediction: Prediction | None = None  # None: decided before pricing anything
    decode_id: str = ""
    prefill_id: str = ""
    num_prefill_tokens: int = 0  # uncached tokens the chosen worker computes
    prefill_chunk_tokens: int | None = None  # local in SLO-sized chunks: the chunk

    @property
    def predictions(self) -> dict[str, float]:
        return self.prediction.as_dict() if self.prediction else {}


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
    p = predict(s, model, slo_ttft_s, slo_itl_s, stall_bound)
    if p is None:
        if slo_itl_s is None and not (stall_budget_on and s.num_decodes):
            return _as(local, "no_itl_slo")
        if local_tokens <= fallback_prompt_tokens:
            return _as(local, "fallback_short")
        return _as(remote, "fallback_long")
    if stall_bound:  # which budget the ITL predictions were held to, for /v1/status
        p = dataclasses.replace(p, stall_budget_s=p.itl_budget_s)
    return _priced(s, model, local, remote, p, gap_s is not None, stall_bound)


def _priced(
    s: Situation,
    model: OnlineCostModel,
    local: Decision,
    remote: Decision,
    p: Prediction,
    stall_applies: bool,
    stall_bound: bool,
) -> Decision:
    """The rows from `fits_slo` on (the module docstring), once both paths are priced."""
    chunk = p.slo_chunk.chunk_tokens if p.slo_chunk else 0
    chunked = dataclasses.replace(local, prefill_chunk_tokens=chunk)
    budgets = p.budgets
    if p.local.meets(budgets):
        return _as(local, "fits_slo", p)
    if stall_applies and s.split_breaks_stall:  # a split would freeze the running streams
        if chunked.prefill_chunk_tokens:
            return _as(chunked, "stall_split", p)
        return _beside_decodes(s, model, local, "stall_split", p)
    if p.remote.meets(budgets):
        if _sooner_than_queued_remote(p, budgets, stall_bound):
            return _as(chunked, "prefill_queue", p)
        broken = "stall_budget" if stall_bound else "itl_interference"
        return _as(remote, "ttft" if p.local.itl_s <= budgets.itl_s else broken, p)
    if p.slo_chunk is not None and p.slo_chunk.meets(budgets):
        return _as(chunked, "slo_chunk", p)
    best = min(p.candidates, key=lambda c: c.excess(budgets))  # ties: the first
    if best.path == REMOTE:
        others = [c for c in p.candidates if c.path != REMOTE]
        nearest = min(others, key=lambda c: c.excess(budgets))
        queued = p.queue_remote_s > TTFT_BUDGET_FACTOR * nearest.ttft_s
        free = s.decode_free_tokens
        starves = free is not None and free - local.num_prefill_tokens < s.decode_reserve_tokens
        if queued or starves:  # a backlog's requests must not stall the running decodes
            if chunked.prefill_chunk_tokens:
                return _as(chunked, "remote_backlog", p)
            return _beside_decodes(s, model, local, "remote_backlog", p)
    if best.path == SLO_CHUNK:
        return _as(chunked, "slo_chunk_least_violation", p)
    if best.path == LOCAL and not chunked.prefill_chunk_tokens:
        return _beside_decodes(s, model, local, "least_violation", p)
    return _as(local if best.path == LOCAL else remote, "least_violation", p)


def _sooner_than_queued_remote(p: Prediction, budgets: Budgets, stall_bound: bool) -> bool:
    """Remote meets both budgets, but waits behind the prefill worker's queue or, under the
    stall budget, slows the prompts queued on the decode worker (its split leaves them the
    decode group's share), and local in SLO-sized chunks meets both too with an earlier
    first token, counting that slowdown against remote. Prompts sent to one prefill worker
    prefill together on its share of the cores while the decode worker holds the rest: a
    burst of three 1,024-token prompts on a 1B model's two cores gave the last two 10.1 s
    to their first token, both remote, where collocated's took 5.9 s.

    The slowdown counts only under the stall budget: there the decode worker's StallGuard
    sizes a local prompt's chunks from its own steps on whatever threads it has, so a split
    made for a later prompt shrinks them; an SLO-sized chunk for an ITL target is fixed
    when sent, and on the split share a chunk priced for the pool breaks that target."""
    c = p.slo_chunk
    delay_s = p.split_delay_s if stall_bound else 0.0
    if c is None or not c.meets(budgets) or p.queue_remote_s + delay_s <= 0:
        return False
    return c.ttft_s < p.remote.ttft_s + delay_s


def _beside_decodes(
    s: Situation, model: OnlineCostModel, local: Decision, reason: str, p: Prediction
) -> Decision:
    """Local as a fallback (`remote_backlog`, `least_violation`) with no SLO-sized chunk
    priced: where full chunks would break the ITL of running decodes, in the largest chunks
    whose step, at the prompt's end, stays within 1 / ITL_HEADROOM of the decodes' own step.
    A fallback must not stall the streams already running: a full chunk on a one-core decode
    group is 0.5-1 s per 256 tokens, and queued prompts share a step."""
    if s.num_decodes and p.local.itl_s > p.budgets.itl_s:
        shape = StepShape(0, s.num_decodes, 0, s.decode_context_tokens)
        alone = model.step_s("decode", s.decode_threads_local, shape)
        step_budget_s = (alone or 0) / ITL_HEADROOM
        bound = predict_slo_chunk(s, model, local.num_prefill_tokens, step_budget_s, STALL_CHUNK)
        if bound:
            p = dataclasses.replace(p, stall_chunk=bound)
            local = dataclasses.replace(local, prefill_chunk_tokens=bound.chunk_tokens)
    return _as(local, reason, p)


@dataclass(frozen=True)
class DecodeNeed:
    """The threads a decode group needs for its running decodes (`decode_need()`)."""

    pool: int
    threads: int  # within both budgets (0: no usable model; `pool` when none does)
    stall_threads: int = 0  # within the stall budget alone (0: none applies or no model)

    @property
    def split(self) -> int:
        """The decode group's share while a prefill worker on its host runs: its need, an even
        split before the model is usable, and a core left for the prefill worker."""
        return min(max(1, self.threads or self.pool // 2), self.pool - 1)

    @property
    def split_breaks_stall(self) -> bool:
        """Only every core of the host holds the stall budget: no split does."""
        return 1 < self.pool <= self.stall_threads


def decode_need(
    model: OnlineCostModel,
    pool: int,
    num_decodes: int,
    context_tokens: int,
    slo_itl_s: float | None,
    stall_budget_s: float | None = None,
) -> DecodeNeed:
    """The fewest threads whose decode step of these decodes stays within ITL_HEADROOM of the
    ITL budget and, with a stall budget, within its share (`stall_need()`). The headroom
    leaves room for the requests the batch admits before the planner looks again."""
    if num_decodes <= 0:
        return DecodeNeed(pool, 1)
    shape = StepShape(0, num_decodes, 0, context_tokens)
    unloaded = model.step_s("decode", pool, shape)
    if unloaded is None:
        return DecodeNeed(pool, 0)
    budget = ITL_HEADROOM * (slo_itl_s if slo_itl_s is not None else ITL_BUDGET_FACTOR * unloaded)
    stall = stall_need(model, pool, num_decodes, context_tokens, stall_budget_s)
    return DecodeNeed(pool, max(_fewest(model, pool, shape, budget), stall), stall)


def stall_need(
    model: OnlineCostModel,
    pool: int,
    num_decodes: int,
    context_tokens: int,
    stall_budget_s: float | None,
) -> int:
    """The fewest threads whose step of these decodes alone stays within ITL_HEADROOM of the
    stall budget: what a split leaves the decode group to run while its prompts prefill
    elsewhere, so every running stream's gaps stay within the budget. A local prompt on that
    share is priced as local (`predict`) and capped by the worker's StallGuard
    (engine/stall_guard.py), and a remote request's own first gap (two such steps) is
    priced as remote's: neither sizes the group. Counting the guard's least chunk here made
    every 512-token prompt of a 1B model prefill locally in 30-55-token chunks (TTFT 10-14
    s) where a split held the decodes' steps at 56-124 ms under a 257 ms budget; holding the
    decodes to the guard's 45% sent prompts local in 4-token chunks (TTFT 23-28 s) where the
    split's steps, priced at 138-192 ms, held the running streams. 0: no budget or no decodes;
    `pool` when none does."""
    if stall_budget_s is None or num_decodes <= 0:
        return 0
    shape = StepShape(0, num_decodes, 0, context_tokens)
    return _fewest(model, pool, shape, ITL_HEADROOM * stall_budget_s)


def _fewest(model: OnlineCostModel, pool: int, shape: StepShape, budget_s: float) -> int:
    """The fewest threads of the pool whose decode-worker step of `shape` fits `budget_s`."""
    for threads in range(1, pool + 1):
        step = model.step_s("decode", threads, shape)
        if step is not None and step <= budget_s:
            return threads
    return pool


def _as(decision: Decision, reason: str, prediction: Prediction | None = None) -> Decision:
    return dataclasses.replace(decision, reason=reason, prediction=prediction)
