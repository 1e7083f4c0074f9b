"""`--deployment adaptive`: a prefill and a decode worker sharing the cores of one collocated
worker (`collocated_size`), driven by the adaptive planner's own parts (pdserve/planner,
docs/adaptive.md): `decide()` places each request, `plan_counts()` and `CoreGroups` move
the cores, and the planner's cost model, seeded from the profile, prices both — the same
calls the router's `Planner` makes. Its link is the one the simulated transfers cross (the
profile's figures for `SimConfig.transfer_backend`), so a slow link makes remote rarer here
as in the router, where the prefill workers' sends measure it.

Modelled: a SetCores applies at the worker's next step boundary (a worker mid-step finishes
the step first) and is acknowledged at once; a parked worker runs no step; a thread count
the profile has no model for is priced as the planner prices it (the nearest one, scaled);
a local prefill carries the stall budget the router sends (`enforced_gap_s()`) and the
decode worker's own StallGuard (engine/stall_guard.py, in its scheduler) caps its chunks
beside running decodes from the simulated steps' times, as the worker measures its own.
Not modelled: StepReport (the profile is the truth, so there is nothing to learn) and the
P:D split across workers (one of each here).
"""

from __future__ import annotations

import collections
import dataclasses

from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import StepShape
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.cores import CoreGrant, CoreGroups, Demand, plan_counts, stall_floors
from pdserve.planner.decision import LOCAL, DecodeNeed, Situation, decide, decode_need
from pdserve.planner.model import OnlineCostModel
from pdserve.planner.targets import enforced_gap_s, max_gap_s, stall_budget_on
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.simulator import Simulation, _Flight
from pdserve.sim.worker import SimWorker


@dataclasses.dataclass(frozen=True)
class _Priced:
    """A worker's step cost at its current threads, as the planner's model prices it."""

    model: OnlineCostModel
    role: str
    threads: int

    def predict(self, shape: StepShape) -> float:
        step_s = self.model.step_s(self.role, self.threads, shape)
        assert step_s is not None, "a profile-seeded model prices every thread count"
        return step_s

    def wake_s(self, idle_s: float) -> float:
        return self.model.wake_s(self.role, self.threads, idle_s)


class AdaptiveSimulation(Simulation):
    def __init__(
        self,
        profile: HardwareProfile,
        deployment: Deployment,
        config: SimConfig | None = None,
        adaptive: AdaptiveConfig | None = None,
    ) -> None:
        super().__init__(profile, deployment, config)
        self.adaptive = adaptive or AdaptiveConfig(enabled=True)
        self.model = OnlineCostModel(self.adaptive.min_samples, profile)
        self.model.link = self.transfer  # the link the flights cross (`transfer_backend`)
        slos_ms = (self.adaptive.slo_ttft_ms, self.adaptive.slo_itl_ms)
        self._slo_ttft_s, self._slo_itl_s = (ms / 1000 if ms else None for ms in slos_ms)
        self.pool = tuple(range(deployment.collocated_size))
        ids = [w.worker_id for w in self.workers]
        a = self.adaptive
        self.groups = CoreGroups(
            self.pool, ids, a.core_dwell_s, a.core_hold_gaps, a.core_hold_max_s
        )
        self.by_id = {w.worker_id: w for w in self.workers}
        self.pending: dict[str, CoreGrant] = {}  # sent, applied at the worker's step boundary
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        for w in self.workers:  # as the launcher starts them: decode on every core
            threads = len(self.pool) if w.role == "decode" else 0
            self.groups.on_ready(w.worker_id, self.pool, threads, restarted=True)
            self._run_on(w, threads)
        self._replan()

    # ---- requests --------------------------------------------------------------------

    def _admit_disaggregated(self, flight: _Flight) -> None:
        self._replan()
        decode = self._choose("decode", flight)
        decision = decide(
            self._situation(flight, decode),
            self.model,
            self._slo_ttft_s,
            self._slo_itl_s,
            self.adaptive.fallback_prompt_tokens,
            max_gap_s(self.adaptive, self.model, len(self.pool)),
            stall_budget_on(self.adaptive),
        )
        self.decisions[(decision.kind, decision.reason)] += 1
        if decision.kind == LOCAL:
            decode.num_active_requests += 1
            self._charge(flight, decode)
            flight.decode, flight.decode_worker = self._request(flight), decode
            flight.decode.prefill_chunk_tokens = decision.prefill_chunk_tokens
            flight.decode.stall_budget_s = enforced_gap_s(self.adaptive, self.model, len(self.pool))
            decode.add(flight.decode)
        else:
            self.groups.on_remote(self.now)
            super()._admit_disaggregated(flight)
        self._replan()
        self._kick(decode)

    def _situation(self, flight: _Flight, decode: SimWorker) -> Situation:
        prefill = self.by_role["prefill"][0]
        pool = len(self.pool)
        d, p = decode.load(flight.block_hashes), prefill.load(flight.block_hashes)
        need = self._decode_need(decode)  # the core plan's: it keeps the split
        # A held split (cores.py's hold) keeps the decode group small while the prefill idles.
        prefill_busy = self._busy(prefill) or self.groups.threads(prefill.worker_id) > 0
        local_threads = max(1, decode.size)
        if not need.split_breaks_stall:
            local_threads = min(local_threads, need.split)
        return Situation(
            num_prompt_tokens=len(flight.prompt_ids),
            num_cached_decode_tokens=d.num_cached_blocks * self.config.block_size,
            num_cached_prefill_tokens=p.num_cached_blocks * self.config.block_size,
            pool_size=pool,
            num_decodes=max(d.num_running, d.num_active_requests),
            decode_context_tokens=(d.num_total_blocks - d.num_free_blocks) * self.config.block_size,
            decode_queue_tokens=d.num_queued_prefill_tokens,
            # Its share once the split is made (a SetCores waits for its step boundary), as
            # the router's planner prices it.
            decode_threads_local=local_threads if prefill_busy else pool,
            decode_threads_split=need.split,
            prefill_threads=pool - need.split,
            prefill_queue_tokens=p.num_queued_prefill_tokens,
            prefill_parked=self.groups.threads(prefill.worker_id) == 0,
            switch_s=0.0,
            kv_bytes_per_token=self.kv_bytes_per_token,
            chunk_tokens=self.config.scheduler.long_prefill_token_threshold,
            decode_free_tokens=d.num_free_blocks * self.config.block_size,
            decode_reserve_tokens=max(d.num_running, d.num_active_requests)
            * self.config.block_size,
            split_breaks_stall=need.split_breaks_stall,
        )

    # ---- cores -----------------------------------------------------------------------

    def _busy(self, w: SimWorker) -> bool:
        return w.scheduler.has_unfinished() or w.num_active_requests > 0

    def _decode_need(self, w: SimWorker) -> DecodeNeed:
        """As the router's planner: the running decodes, for the core plan and the decision."""
        load = w.load()
        context = (load.num_total_blocks - load.num_free_blocks) * self.config.block_size
        pool = len(self.pool)
        budget = max_gap_s(self.adaptive, self.model, pool)
        return decode_need(self.model, pool, load.num_running, context, self._slo_itl_s, budget)

    def _demand(self, w: SimWorker) -> Demand:
        if w.role != "decode":
            busy = self._busy(w)
            parked_s = self.groups.parked_s(w.worker_id, busy, self.now)
            return Demand(w.worker_id, w.role, busy, parked_s=parked_s)
        need = self._decode_need(w)
        return Demand(w.worker_id, w.role, self._busy(w), need.threads, need.stall_threads)

    def _replan(self) -> None:
        demands = [self._demand(w) for w in self.workers]
        roles = {w.worker_id: w.role for w in self.workers}
        counts = plan_counts(len(self.pool), demands)
        self.groups.want(counts, roles, self.now, stall_floors(demands))
        self._send_cores()

    def _send_cores(self) -> None:
        for worker_id, cores in self.groups.sends(self.now):
            self.pending[worker_id] = cores
            worker = self.by_id[worker_id]
            if not worker.is_busy:
                self._apply(worker)

    def _apply(self, worker: SimWorker) -> None:
        cores = self.pending.pop(worker.worker_id, None)
        if cores is None:
            return
        self._run_on(worker, cores.threads)
        self.groups.on_ack(worker.worker_id, cores.cpus, cores.threads, self.now)
        self._send_cores()  # a grow may have waited for this shrink
        for other in self.workers:
            if other is not worker:
                self._kick(other)

    def _run_on(self, worker: SimWorker, threads: int) -> None:
        worker.size = threads
        worker.scheduler.stall_guard.threads = max(1, threads)
        worker.cost_model = _Priced(self.model, worker.role, threads)  # type: ignore[assignment]

    # ---- the loop's hooks ------------------------------------------------------------

    def _kick(self, worker: SimWorker) -> None:
        if not worker.is_busy:
            self._apply(worker)  # between steps: its SetCores takes effect now
        if worker.size > 0:
            super()._kick(worker)

    def _step_done(self, worker: SimWorker) -> None:
        step = worker.step
        if step is not None:  # the worker measures its own steps (the engine's observe())
            shape = step.shape
            worker.scheduler.stall_guard.observe(
                max(1, worker.size), shape.prefill_tokens, shape.decode_requests, step.duration_s
            )
        super()._step_done(worker)
        self._replan()

    def summary(self) -> dict[str, object]:
        """What `pdserve simulate` prints of the planner: its decisions by kind and reason,
        and the decode worker's stall guard (its budget, last cap, steps the cap bound)."""
        decode = self.by_role["decode"][0].scheduler.stall_guard
        return {
            "decisions": {f"{k}/{r}": n for (k, r), n in sorted(self.decisions.items())},
            **decode.fields(),
        }

    def _landed(self, payload: tuple[SimWorker, _Flight]) -> None:
        super()._landed(payload)
        self._replan()

    def _start_decode(self, flight: _Flight) -> None:
        super()._start_decode(flight)
        self._replan()
