"""The adaptive planner the router owns (docs/adaptive.md): per-request decisions, core
groups per host, the P:D split. It reads the router's worker table (`ControlPlane`), hears
Ready, CoresSet and StepReport from it, sends SetCores and SwitchRole through it, and ticks
every `interval_s` (sooner when a request waits for cores or a worker acknowledged a change).
The policy parts it calls (decision.py, cores.py, roles.py, model.py) are pure.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve import messages
from pdserve.costmodel.profile import load_profile
from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.cores import (
    CoreGroups,
    Demand,
    check_deployment,
    plan_counts,
    pools_of,
    stall_floors,
)
from pdserve.planner.decision import (
    REMOTE,
    Decision,
    DecodeNeed,
    Situation,
    decide,
    decode_need,
)
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.roles import RoleSplit, RoleView
from pdserve.planner.targets import describe, enforced_gap_s, max_gap_s, stall_budget_on

if TYPE_CHECKING:
    from pdserve.router.control_plane import ControlPlane, WorkerState
    from pdserve.router.metrics import AdaptiveMetrics
    from pdserve.router.policies import RouteRequest, RoutingPolicy, WorkerLoad
    from pdserve.router.timing import RequestTiming

log = logging.getLogger(__name__)

NUM_RECENT = 32  # decisions kept for /v1/status
NUM_LATENCIES = 64  # core switch latencies kept (the mean prices a remote prefill's switch)


class Planner:
    def __init__(
        self,
        config: AdaptiveConfig,
        plane: ControlPlane,
        metrics: AdaptiveMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_deployment(plane.config.workers)
        self.config, self.plane, self.metrics, self.clock = config, plane, metrics, clock
        profile = load_profile(config.profile) if config.profile else None
        self.model = OnlineCostModel(config.min_samples, profile)
        self.groups: dict[str, CoreGroups] = {}  # worker -> its host's groups
        for (_, pool), ids in pools_of(plane.config.workers).items():
            groups = CoreGroups(
                pool, ids, config.core_dwell_s, config.core_hold_gaps, config.core_hold_max_s
            )
            self.groups.update(dict.fromkeys(ids, groups))
        self.roles = RoleSplit(config.min_dwell_s, window_s=2 * config.interval_s)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=NUM_RECENT)
        self.decision_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.switch_s: collections.deque[float] = collections.deque(maxlen=NUM_LATENCIES)
        self.round_trip_s: collections.deque[float] = collections.deque(maxlen=NUM_LATENCIES)
        self._epochs: dict[str, int] = {}
        self._wanted: collections.Counter[str] = collections.Counter()  # waiting for cores
        # Remote decisions whose Prefill is not sent yet: request -> (prefill worker, uncached
        # tokens, decided at). See `_undispatched_tokens()`.
        self._undispatched: dict[str, tuple[str, int, float]] = {}
        self._grants: dict[str, list[asyncio.Future[None]]] = collections.defaultdict(list)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_refit = -math.inf

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="adaptive-planner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # a planning bug must not stop the router serving
                log.exception("adaptive planner tick failed")

    # ---- messages (from ControlPlane._dispatch) -----------------------------------------

    def on_message(self, message: Any) -> None:
        worker = self.plane.workers[message.worker_id]
        groups = self.groups.get(message.worker_id)
        if isinstance(message, messages.StepReport):
            self.model.observe_steps(worker.role, message.steps)
        elif isinstance(message, messages.Ready) and groups is not None:
            restarted = self._epochs.get(worker.worker_id) != worker.epoch
            self._epochs[worker.worker_id] = worker.epoch
            groups.on_ready(worker.worker_id, message.cpus, message.threads, restarted)
            self._wake.set()
        elif isinstance(message, messages.CoresSet) and groups is not None:
            round_trip = groups.on_ack(
                message.worker_id, message.cpus, message.threads, self.clock()
            )
            self.switch_s.append(message.switch_s)
            if round_trip is not None:
                self.round_trip_s.append(round_trip)
            if self.metrics is not None:
                self.metrics.core_switch(
                    message.worker_id, message.threads, message.switch_s, round_trip
                )
            log.info(
                "worker %s: %d threads on cpus %s (switch %.3f s)",
                message.worker_id,
                message.threads,
                message.cpus,
                message.switch_s,
            )
            self._send(groups)  # a grow may have waited for this shrink
            self._release(groups)

    # ---- the driver's questions ---------------------------------------------------------

    def decide(self, key: str, route: RouteRequest, policy: RoutingPolicy) -> Decision:
        """Where this request prefills; `decode_id` / `prefill_id` name the candidates."""
        loads = self.plane.loads(route.block_hashes)
        decode = policy.choose("decode", loads, route)
        prefill = policy.choose("prefill", loads, route)
        if decode is None:  # the disaggregated path reports what is missing
            return Decision(REMOTE, "no_decode_worker")
        slo_ttft = self.config.slo_ttft_ms / 1000 if self.config.slo_ttft_ms else None
        slo_itl = self._slo_itl_s
        situation = self._situation(route, decode, prefill)
        max_gap = max_gap_s(self.config, self.model, situation.pool_size)
        decision = decide(
            situation,
            self.model,
            slo_ttft,
            slo_itl,
            self.config.fallback_prompt_tokens,
            max_gap,
            stall_budget_on(self.config),
        )
        decision = dataclasses.replace(
            decision, decode_id=decode.worker_id, prefill_id=prefill.worker_id if prefill else ""
        )
        if decision.kind == REMOTE and decision.prefill_id in self.groups:
            self.groups[decision.prefill_id].on_remote(self.clock())
        self._undispatched.pop(key, None)  # a re-drive decides again
        if decision.kind == REMOTE and decision.prefill_id:
            entry = (decision.prefill_id, decision.num_prefill_tokens, self.clock())
            self._undispatched[key] = entry
        self._record(key, decision)
        return decision

    def dispatched(self, key: str) -> None:
        """The request's Prefill goes out now (or never will): from here the router's
        charge on the worker counts its prompt (`WorkerState.sent_prefill_tokens`)."""
        self._undispatched.pop(key, None)

    def _undispatched_tokens(self, worker_id: str) -> int:
        """Prompt tokens decided remote on `worker_id` and not sent yet. A remote request
        sends its Prefill only after the decode worker's Reserved and the prefill worker's
        cores, a decode step or more after its decision, and until then no queue shows it:
        a prompt decided 40 ms after another (a burst of 1,024-token prompts on a 1B model)
        was priced as if the prefill worker were free and queued behind it. An entry left
        by a request that ended before its send goes after the admission timeout, which
        bounds that wait."""
        horizon = self.clock() - self.plane.config.admission_timeout_s
        for key in [k for k, (_, _, t) in self._undispatched.items() if t < horizon]:
            del self._undispatched[key]
        return sum(n for w, n, _ in self._undispatched.values() if w == worker_id)

    def stall_budget_s(self, worker_id: str) -> float | None:
        """The stall budget `worker_id` holds its local prefills to beside running decodes
        (`enforced_gap_s()`); None for a worker the planner does not plan."""
        groups = self.groups.get(worker_id)
        return None if groups is None else enforced_gap_s(self.config, self.model, len(groups.pool))

    def _situation(
        self, route: RouteRequest, decode: WorkerLoad, prefill: WorkerLoad | None
    ) -> Situation:
        d = self.plane.workers[decode.worker_id]
        groups = self.groups[d.worker_id]
        pool = len(groups.pool)
        block_size = d.ready.block_size if d.ready else route.block_size
        decode_threads = max(1, groups.threads(d.worker_id))
        split, prefill_threads, parked, busy = decode_threads, pool, False, False
        breaks_stall = False
        if prefill is not None:
            p_groups = self.groups[prefill.worker_id]
            parked = not p_groups.runs(prefill.worker_id)  # or being parked
            prefill_threads = p_groups.threads(prefill.worker_id) or len(p_groups.pool)
            if p_groups is groups:  # one host: a remote prefill splits the pool
                need = self._decode_need(d, pool)  # the core plan's: it keeps the split
                split, breaks_stall = need.split, need.split_breaks_stall
                prefill_threads = pool - split
                # A held split (cores.py's hold) keeps the decode group small while idle.
                busy = not parked or self._busy(self.plane.workers[prefill.worker_id])
        return Situation(
            num_prompt_tokens=route.num_prompt_tokens,
            num_cached_decode_tokens=decode.num_cached_blocks * route.block_size,
            num_cached_prefill_tokens=prefill.num_cached_blocks * route.block_size
            if prefill
            else 0,
            pool_size=pool,
            # Stats are a heartbeat old: what the router sent since counts too.
            num_decodes=max(decode.num_running, decode.num_active_requests),
            decode_context_tokens=(decode.num_total_blocks - decode.num_free_blocks) * block_size,
            decode_queue_tokens=decode.num_queued_prefill_tokens,
            # Its share once the split a busy prefill worker asks for is made, not the
            # threads it holds until it acknowledges the shrink (none where no split holds
            # the stall budget: the plan keeps the pool with the decodes).
            decode_threads_local=(decode_threads if breaks_stall else min(decode_threads, split))
            if busy
            else pool,
            decode_threads_split=split,
            prefill_threads=prefill_threads,
            prefill_queue_tokens=prefill.num_queued_prefill_tokens
            + self._undispatched_tokens(prefill.worker_id)
            if prefill
            else 0,
            prefill_parked=parked,
            switch_s=statistics.fmean(self.round_trip_s) if self.round_trip_s else 0.0,
            kv_bytes_per_token=d.ready.kv_block_bytes / block_size if d.ready else 0.0,
            chunk_tokens=self.config.prefill_chunk_tokens,
            has_prefill=prefill is not None,
            decode_free_tokens=decode.num_free_blocks * block_size
            if decode.num_total_blocks
            else None,
            # A block each: what the running decodes take next as they grow.
            decode_reserve_tokens=max(decode.num_running, decode.num_active_requests) * block_size,
            split_breaks_stall=breaks_stall,
        )

    async def cores_granted(self, worker_id: str, timeout_s: float) -> bool:
        """Wait until `worker_id` runs steps and is not being parked (`CoreGroups.runs`);
        False past `timeout_s`. A worker the planner does not plan is always granted."""
        groups = self.groups.get(worker_id)
        if groups is None or groups.runs(worker_id):
            return True
        future = asyncio.get_running_loop().create_future()
        self._grants[worker_id].append(future)
        self._wanted[worker_id] += 1
        self._wake.set()
        try:
            await asyncio.wait_for(future, max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False
        finally:
            self._wanted[worker_id] -= 1
            if self._wanted[worker_id] <= 0:
                del self._wanted[worker_id]

    def on_landed(self, decision: Decision, timing: RequestTiming, num_blocks: int) -> None:
        """A remote request's KV landed: its exposed transfer time is a transfer sample."""
        stamps = timing.stamps
        worker = self.plane.workers.get(decision.decode_id)
        if "prefill_end" in stamps and "kv_landed" in stamps and worker and worker.ready:
            seconds = stamps["kv_landed"] - stamps["prefill_end"]
            self.model.observe_transfer(num_blocks * worker.ready.kv_block_bytes, seconds)

    # ---- planning -----------------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        if now - self._last_refit >= self.config.interval_s:
            self._last_refit = now
            for w in self.plane.workers.values():  # the link, as the prefill workers' sends see it
                if w.stats is not None and w.stats.kv_send_s > 0:
                    self.model.observe_link(w.worker_id, w.stats.kv_bytes_sent, w.stats.kv_send_s)
            self.model.refit()
        for groups in {id(g): g for g in self.groups.values()}.values():
            ids = list(groups.current)
            demands = [self._demand(self.plane.workers[w], len(groups.pool)) for w in ids]
            roles = {w: self.plane.workers[w].role for w in ids}
            counts = plan_counts(len(groups.pool), demands)
            if groups.want(counts, roles, now, stall_floors(demands)):
                log.info("core groups: %s", groups.counts)
            self._send(groups)
            self._release(groups)  # a park given up before it was sent: no CoresSet comes
        self._plan_roles(now)

    def _send(self, groups: CoreGroups) -> None:
        for worker_id, cores in groups.sends(self.clock()):
            self.plane.send(worker_id, messages.SetCores(list(cores.cpus), cores.threads))

    def _release(self, groups: CoreGroups) -> None:
        """Let the requests waiting for cores on a worker of `groups` that runs go on."""
        for worker_id in [w for w in self._grants if self.groups[w] is groups and groups.runs(w)]:
            for future in self._grants.pop(worker_id):
                if not future.done():
                    future.set_result(None)

    def _busy(self, w: WorkerState) -> bool:
        s = w.stats
        running = s is not None and s.num_running + s.num_waiting > 0
        work = w.active_requests > 0 or w.sent_prefill_tokens > 0 or running
        return self._wanted[w.worker_id] > 0 or (work and self.plane.is_healthy(w.worker_id))

    def _demand(self, w: WorkerState, pool: int) -> Demand:
        if w.role == "prefill":
            busy = self._busy(w)
            parked_s = self.groups[w.worker_id].parked_s(w.worker_id, busy, self.clock())
            return Demand(w.worker_id, w.role, busy, parked_s=parked_s)
        need = self._decode_need(w, pool)
        return Demand(w.worker_id, w.role, self._busy(w), need.threads, need.stall_threads)

    def _decode_need(self, w: WorkerState, pool: int) -> DecodeNeed:
        """The decodes running in its Stats, for the core plan and the decision alike. Not
        the requests waiting on a prefill worker: a decode group is not sized for requests
        the plan would park (they would never run). The decision asks whether the plan keeps
        a split, so it counts what the plan counts: counting those waiting too, it found
        no split held and priced a prompt local beside the decodes on the share the plan
        kept (one core of an AVX2 host, 1B: 0.9-1.2 s steps under a 1 s budget)."""
        s = w.stats
        if s is None or w.ready is None:  # its block size is in its Ready
            return DecodeNeed(pool, 1)
        context = (s.num_total_blocks - s.num_free_blocks) * w.ready.block_size
        budget = max_gap_s(self.config, self.model, pool)
        return decode_need(self.model, pool, s.num_running, context, self._slo_itl_s, budget)

    @property
    def _slo_itl_s(self) -> float | None:
        return self.config.slo_itl_ms / 1000 if self.config.slo_itl_ms else None

    def _plan_roles(self, now: float) -> None:
        views = []
        for w in self.plane.workers.values():
            s = w.stats
            occupancy = (
                1 - s.num_free_blocks / s.num_total_blocks if s and s.num_total_blocks else 0.0
            )
            views.append(
                RoleView(
                    w.worker_id,
                    w.role,
                    self.plane.is_healthy(w.worker_id) and not w.switching_to,
                    w.switching_to is not None,
                    occupancy,
                    w.active_requests,
                    self._prefill_capacity(w.worker_id),
                )
            )
        choice = self.roles.choose(now, views, self.roles.demand_tokens_per_s(now))
        if choice is None:
            return
        worker_id, role, reason = choice
        if self.plane.switch_role(worker_id, role):
            self.roles.switched(now, worker_id)
            log.info("worker %s switches to %s (%s)", worker_id, role, reason)
            if self.metrics is not None:
                self.metrics.role_switch(role, reason)

    def _prefill_capacity(self, worker_id: str) -> float | None:
        """Prompt tokens/s the worker carries as a prefill worker on its even share of its
        host's cores, in full chunks."""
        groups = self.groups[worker_id]
        threads = max(1, len(groups.pool) // len(groups.current))
        chunk = self.config.prefill_chunk_tokens
        step = self.model.step_s(
            "prefill", threads, StepShape(chunk, 0, chunk * (chunk + 1) / 2, 0)
        )
        return chunk / step if step else None

    def _record(self, key: str, d: Decision) -> None:
        self.decision_counts[(d.kind, d.reason)] += 1
        if d.kind == REMOTE or d.reason.endswith("least_violation") or d.reason == "remote_backlog":
            self.roles.add_demand(self.clock(), d.num_prefill_tokens)
        if self.metrics is not None:
            self.metrics.decision(d.kind, d.reason)
        p = {k: round(v, 4) for k, v in d.predictions.items()}
        self.recent.append(
            {
                "t": round(time.time(), 3),
                "request": key,
                "kind": d.kind,
                "reason": d.reason,
                "decode": d.decode_id,
                "prefill": d.prefill_id,
                "num_prefill_tokens": d.num_prefill_tokens,
                "prefill_chunk_tokens": d.prefill_chunk_tokens,
                "predictions": p,
            }
        )
        log.debug(
            "request %s: %s prefill (%s) on %s, predicted %s",
            key,
            d.kind,
            d.reason,
            d.prefill_id if d.kind == REMOTE else d.decode_id,
            p,
        )

    # ---- /v1/status ---------------------------------------------------------------------

    def cores_of(self, worker_id: str) -> tuple[list[int], int] | None:
        """The cpus and threads a worker last acknowledged (or announced); None if unknown."""
        groups = self.groups.get(worker_id)
        current = groups.current.get(worker_id) if groups else None
        return None if current is None else (list(current.cpus), current.threads)

    def status(self) -> dict[str, Any]:
        roles = collections.Counter(w.role for w in self.plane.workers.values())
        groups = {id(g): g for g in self.groups.values()}.values()
        return {
            "split": {"prefill": roles["prefill"], "decode": roles["decode"]},
            "core_groups": [g.state() for g in groups],
            "num_core_switches": sum(g.num_switches for g in groups),
            "num_role_switches": self.roles.num_switches,
            "core_switch_s": _summary(self.switch_s),
            "core_switch_round_trip_s": _summary(self.round_trip_s),
            "prefill_demand_tokens_per_s": self.roles.demand_tokens_per_s(self.clock()),
            "decisions": {f"{k}/{r}": n for (k, r), n in sorted(self.decision_counts.items())},
            "recent_decisions": list(self.recent),
            "model": self.model.state(),
            "targets": describe(self.config, self.model, [g.pool for g in groups]),
            "decode_needs": self._needs(),
        }

    def _needs(self) -> dict[str, dict[str, Any]]:
        """Per decode worker, the threads its running decodes need (`decode_need()`): within
        both budgets, within the stall budget alone, and whether no split of its host holds
        that (then no remote prefill splits it: `stall_split`)."""
        out = {}
        for w in self.plane.workers.values():
            if w.role != "prefill" and w.worker_id in self.groups:
                need = self._decode_need(w, len(self.groups[w.worker_id].pool))
                out[w.worker_id] = {
                    "threads": need.threads,
                    "stall_threads": need.stall_threads,
                    "split_breaks_stall": need.split_breaks_stall,
                }
        return out


def _summary(values: Any) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "max": max(values), "num": len(values)}
