"""A simulated worker: pdserve's own Scheduler and KVCacheManager, with the model's forward
pass replaced by the time the cost model gives the step. Everything the scheduler decides
(chunked prefill, preemption, prefix hits, block accounting) is the real code deciding it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.config import SchedulerConfig
from pdserve.costmodel.step_cost import ServedCostModel, StepCostModel, StepShape
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.router.policies import WorkerLoad


@dataclass(slots=True)
class Step:
    """A step in flight: what runs, the tokens it will produce, when it ends."""

    output: SchedulerOutput
    sampled: dict[str, int]
    shape: StepShape
    duration_s: float


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        role: str,
        size: int,
        cost_model: StepCostModel | ServedCostModel,
        num_blocks: int,
        block_size: int,
        scheduler_config: SchedulerConfig,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        model_id: str = "",
        token_cpu_s: float = 0.0,
        stats_every_s: float = 0.0,
    ) -> None:
        self.worker_id, self.role, self.size = worker_id, role, size
        self.cost_model = cost_model
        # The serving stack's CPU per streamed token, taken from a step when no core is free.
        self.token_cpu_s = token_cpu_s
        self.kv = KVCacheManager(num_blocks, block_size, model_id, enable_prefix_caching)
        self.scheduler = Scheduler(
            scheduler_config, self.kv, max_model_len, preallocate_prompt=role == "prefill"
        )
        self.step: Step | None = None
        self.num_active_requests = 0  # routed here and not yet done, as the router counts
        self.num_preemptions = 0
        self.steps: list[tuple[StepShape, float]] | None = None  # recorded when a list
        self.idle_since = float("-inf")  # when its last step ended: idle since the start
        # What its last Stats said (report()): before the first, idle with every block free.
        self.reported = _Reported(0, 0, num_blocks, 0)
        # The real worker reads requests from its socket before a step and refreshes its
        # Stats after one, at most every `stats_every_s` (workers/worker.py, run). So while
        # a step runs, its Stats are the state at the last refresh (or when it last idled),
        # without the requests `unseen` since: those read after it or not read yet.
        self.unseen: list[Request] = []
        self.arrived_in_step: list[Request] = []  # read when the next step starts
        self.snapshot = (0, 0, num_blocks)  # num_waiting, num_running, num_free_blocks
        self.stats_every_s = stats_every_s
        self.next_stats_s = 0.0  # the rate limit's next refresh
        self.sent_prefill_tokens = 0  # prompt tokens routed here, first token not yet out
        # Of those, the prompts its last Stats did not count yet, by request id: the router's
        # load adds only these (router/control_plane.py, `WorkerState.unseen_prompts`).
        self.unseen_prompts: dict[str, int] = {}
        self.unseen_prompt_tokens = 0  # their sum
        self.seeds: dict[str, int] = {}  # output token seeds by request id (crc32 once)

    @property
    def is_busy(self) -> bool:
        return self.step is not None

    def add(self, request: Request) -> None:
        """Queue `request` here: its Stats show it from the first refresh after a step that
        read it (`report`)."""
        self.scheduler.add_request(request)
        self.unseen.append(request)
        if self.step is not None:
            self.arrived_in_step.append(request)

    def charge(self, request_id: str, num_tokens: int) -> None:
        self.sent_prefill_tokens += num_tokens
        self.unseen_prompts[request_id] = num_tokens
        self.unseen_prompt_tokens += num_tokens

    def release(self, request_id: str, num_tokens: int) -> None:
        self.sent_prefill_tokens -= num_tokens
        self.unseen_prompt_tokens -= self.unseen_prompts.pop(request_id, 0)

    def _snapshot(self) -> None:
        """Stats as the real worker refreshes them: the `unseen` requests not yet read."""
        s = self.scheduler
        waiting = max(0, s.num_waiting - len(self.unseen))
        self.snapshot = (waiting, s.num_running, self.kv.num_free_blocks)

    def _went_idle(self) -> None:
        self.unseen = []  # the idle loop reads its socket and refreshes its Stats

    def start_step(self, now: float, contended: bool = False) -> Step | None:
        """Schedule the next step at `now`, or None when there is nothing to run. A step after
        idle time costs the model's `wake_s` more (the machine woke up for it); one that
        starts while every core is taken (`contended`) costs `token_cpu_s` per token it
        streams more (the router and the client run on its cores)."""
        if not self.scheduler.has_unfinished():
            self._went_idle()
            return None
        if now > self.idle_since:  # it sat idle, its Stats current: they are taken now
            self._snapshot()
        out = self.scheduler.schedule()
        if not out.scheduled:
            self._went_idle()
            return None
        # A deterministic output token per request and position (never an EOS: simulated
        # requests carry none), distinct so multi-turn histories hash like real answers.
        sampled, seeds = {}, self.seeds
        for r, n in out.scheduled:
            if r.num_computed_tokens + n == r.num_tokens:  # out.samples(r, n), inlined
                seed = seeds.get(r.request_id)
                if seed is None:
                    seed = seeds[r.request_id] = zlib.crc32(r.request_id.encode())
                sampled[r.request_id] = 1 + (seed + 7919 * len(r.output_token_ids)) % 30011
        shape = StepShape.of(out.scheduled)
        duration_s = self.cost_model.predict(shape) + self.cost_model.wake_s(now - self.idle_since)
        if contended:
            duration_s += self.token_cpu_s * len(sampled)
        self.step = Step(out, sampled, shape, duration_s)
        self.num_preemptions += len(out.preempted)
        if self.steps is not None:
            self.steps.append((shape, self.step.duration_s))
        return self.step

    def finish_step(self, now: float) -> list[tuple[Request, int | None]]:
        assert self.step is not None
        step, self.step = self.step, None
        self.idle_since = now
        results = self.scheduler.update_from_output(step.output, step.sampled)
        if now >= self.next_stats_s:  # a refresh: what it read before this step is in it
            self.next_stats_s = now + self.stats_every_s
            if self.unseen or self.arrived_in_step:  # most steps: nothing came meanwhile
                self.unseen, self.arrived_in_step = self.arrived_in_step, []
            self._snapshot()
        elif self.arrived_in_step:  # no refresh: those stay unseen, read at the next step
            self.arrived_in_step = []
        return results

    def report(self) -> None:
        """Its Stats at a heartbeat (the load the router sees until the next one): current
        when idle; while a step runs, as the last refresh left them (`unseen`)."""
        s = self.scheduler
        if self.step is None:
            self.reported = _Reported(
                s.num_waiting, s.num_running, self.kv.num_free_blocks, s.num_queued_tokens
            )
            self._counted(())
            return
        unseen = sum(r.num_tokens - r.num_computed_tokens for r in self.unseen if not r.is_finished)
        self.reported = _Reported(*self.snapshot, s.num_queued_tokens - unseen)
        self._counted(self.unseen)

    def _counted(self, unseen: Iterable[Request]) -> None:
        """The router's charges of the prompts these Stats count (here, not `unseen`)."""
        if self.unseen_prompts:
            hidden = {r.request_id for r in unseen}
            requests = self.scheduler.requests
            for request_id in [i for i in self.unseen_prompts if i in requests]:
                if request_id not in hidden:
                    self.unseen_prompt_tokens -= self.unseen_prompts.pop(request_id)

    def load(self, block_hashes: list[int] | None = None) -> WorkerLoad:
        """What the router sees, as `router.control_plane.ControlPlane.loads` builds it: the last
        Stats (`report`), plus its own count of requests here and of prompt tokens sent
        whose first token has not come back; cached prefixes exactly (KVEvents follow each
        step)."""
        cached = 0
        if block_hashes:
            cached = self.kv.num_cached_tokens(block_hashes) // self.kv.block_size
        r = self.reported
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            healthy=True,
            num_waiting=r.num_waiting,
            num_running=r.num_running,
            num_free_blocks=r.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            num_queued_prefill_tokens=r.num_queued_tokens + self.unseen_prompt_tokens,
            num_active_requests=self.num_active_requests,
            num_cached_blocks=cached,
        )


@dataclass(frozen=True)
class _Reported:
    """The part of a worker's Stats the router routes by."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_queued_tokens: int
