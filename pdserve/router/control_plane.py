"""The worker table and the control-plane sockets.

    workers ──PUSH──▶ [router PULL, bound at ctrl_address]   Ready, Stats, Tokens, ...
    router  ──PUSH──▶ [worker PULL, one per worker]          Generate, Reserve, Abort, ...

Incoming messages are dispatched by request_id to the per-request asyncio queue a driver
opened; Ready and Stats update the table. Sends are synchronous non-blocking ZMQ calls, so an
Abort can be sent from a `finally` during task cancellation without awaiting anything.

Failure detection, within a bound: a worker is *lost* when its control connection drops (a
ZMQ socket monitor sees the process die at once) or when no message came from it for
`heartbeat_timeout_s` (a hung process). Losing a worker bumps its epoch (its requests are
gone even if it comes back) and puts a `WorkerLost` into every open request queue, so the
drivers waiting on it re-drive their requests now instead of at their next poll. Every Abort
expects a `Released` back; unacknowledged ones are counted (a metric) and re-sent.

A router that starts sends Hello to every worker, and again to one heard from without a Ready
(its answer was lost): workers that outlived a dead router drop its requests and announce
themselves, so a restarted router routes to them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve import messages
from pdserve.router.config import RouterConfig, WorkerEndpoint
from pdserve.router.frames import FrameReader
from pdserve.router.policies import WorkerLoad

log = logging.getLogger(__name__)

_REQUEST_MESSAGES = (
    messages.Reserved,
    messages.Rejected,
    messages.Tokens,
    messages.Failed,
    messages.Unpinned,
)
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class PlannerHook(Protocol):
    """An adaptive deployment's Planner (router/adaptive_planner.py, which reads this table)."""

    def on_message(self, message: Any) -> None: ...  # Ready, CoresSet or StepReport


@dataclass
class WorkerLost:
    """Put into request queues when a worker is lost (not a wire message)."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class Tick:
    """Put into each empty queue opened with `tick` every watch interval (not a wire
    message): a driver waiting for its next token checks its deadlines when one comes, where
    a timer armed and cancelled per token cost ~7% of the router's GIL-held time at batch 1
    (py-spy)."""


TICK = Tick()


@dataclass
class WorkerState:
    endpoint: WorkerEndpoint
    ready: messages.Ready | None = None
    stats: messages.Stats | None = None
    last_seen: float = 0.0
    epoch: int = 0  # +1 per Ready: a re-announced worker has lost its earlier requests
    sent_prefill_tokens: int = 0  # prompt tokens sent, first token not yet back
    active_requests: int = 0  # requests the router has on this worker now
    # Generate and Prefill sent since its Ready, and the prompt tokens of those its Stats do
    # not count yet (`Stats.num_prompts_received`), by send number: its queue is its Stats'
    # plus these (`ControlPlane.loads`), each prompt counted once.
    num_prompts_sent: int = 0
    unseen_prompts: dict[int, int] = field(default_factory=dict)
    lost: bool = False  # declared dead; cleared when it is heard from (or reconnects) again
    disconnected: bool = False  # its control connection dropped and has not come back
    cached_hashes: set[int] = field(default_factory=set)  # its prefix cache, from KVEvents
    switching_to: str | None = None  # asked to switch roles: not routed to until Ready
    hello_sent: float = 0.0  # when it was last sent Hello (it is sent until a Ready comes)
    retiring: bool = False  # about to be removed: not routed to, finishes what it holds
    step_since: float | None = None  # when its engine step in progress began (its heartbeat)

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    def charge(self, num_tokens: int) -> tuple[int, int]:
        """The prompt of the Generate or Prefill just sent: queued here until its first
        token; returns its (epoch, send number) for `release`."""
        self.sent_prefill_tokens += num_tokens
        self.unseen_prompts[self.num_prompts_sent] = num_tokens
        return self.epoch, self.num_prompts_sent

    def release(self, charge: tuple[int, int], num_tokens: int) -> None:
        """Its first token is back (or it ended): not queued here any more."""
        epoch, number = charge
        if epoch == self.epoch:  # else forgotten already (`forget_requests`)
            self.sent_prefill_tokens = max(0, self.sent_prefill_tokens - num_tokens)
            self.unseen_prompts.pop(number, None)

    def on_stats(self, stats: messages.Stats) -> None:
        self.stats = stats
        for number in [n for n in self.unseen_prompts if n <= stats.num_prompts_received]:
            del self.unseen_prompts[number]  # its Stats count these now

    @property
    def unseen_prompt_tokens(self) -> int:
        return sum(self.unseen_prompts.values())

    def forget_requests(self) -> None:
        """A new epoch (lost, or announced again): none of the router's requests are here."""
        self.sent_prefill_tokens = self.active_requests = self.num_prompts_sent = 0
        self.unseen_prompts.clear()

    @property
    def role(self) -> str:
        return self.ready.role if self.ready else self.endpoint.role


class ControlPlane:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.workers = {w.worker_id: WorkerState(w) for w in config.workers}
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._ticked: dict[str, asyncio.Queue[Any]] = {}  # the queues opened with `tick`
        self._sync_ctx = zmq.Context()
        self._pull: zmq.Socket | None = None
        self._reader: FrameReader | None = None
        self._pushes: dict[str, zmq.Socket] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # worker -> its push socket's monitor and the task reading it
        self._links: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._num_connects = itertools.count()
        self._unknown_logged: set[str] = set()
        # One session for every push socket: each worker sees an increasing part of it.
        self._signer = messages.Signer(config.secret)
        self._verifier = messages.Verifier(config.secret)
        self.unacked_releases: dict[tuple[str, str], float] = {}  # (worker, request) -> sent
        self.planner: PlannerHook | None = None

    async def start(self) -> None:
        self._pull = self._sync_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        self._pull.bind(self.config.ctrl_address)
        for worker in self.workers.values():
            self._connect(worker)
        self._reader = FrameReader(self._pull, self._on_frame)
        self._reader.start()
        self._tasks.append(asyncio.create_task(self._watch_loop()))

    def _connect(self, worker: WorkerState) -> None:
        push = self._sync_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 100_000)
        monitor_ctx = zmq.asyncio.Context.shadow(self._sync_ctx.underlying)
        address = f"inproc://monitor-{id(self)}-{worker.worker_id}-{next(self._num_connects)}"
        push.monitor(address, _MONITOR_EVENTS)
        monitor = monitor_ctx.socket(zmq.PAIR)
        monitor.connect(address)
        push.connect(worker.endpoint.address)
        self._pushes[worker.worker_id] = push
        task = asyncio.create_task(self._monitor_loop(worker, monitor))
        self._links[worker.worker_id] = (monitor, task)
        self._hello(worker)

    def _disconnect(self, worker_id: str) -> None:
        monitor, task = self._links.pop(worker_id)
        task.cancel()
        push = self._pushes.pop(worker_id)
        push.disable_monitor()
        monitor.close(linger=0)
        push.close(linger=0)

    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        """Serve a worker started after the router (scaling), or one that came back at another
        address (restarted elsewhere): its earlier requests are lost, as on any restart."""
        worker = self.workers.get(endpoint.worker_id)
        if worker is not None and worker.endpoint == endpoint:
            return
        if worker is not None:
            self.lose(endpoint.worker_id, f"it moved to {endpoint.address}")
            self._disconnect(endpoint.worker_id)
            worker.endpoint, worker.ready = endpoint, None
        else:
            worker = self.workers[endpoint.worker_id] = WorkerState(endpoint)
        log.info("worker %s at %s added", endpoint.worker_id, endpoint.address)
        self._connect(worker)

    def retire(self, worker_id: str) -> bool:
        """Route nothing new to a worker; True once it holds no request of the router's."""
        worker = self.workers[worker_id]
        worker.retiring = True
        return worker.active_requests == 0 and worker.sent_prefill_tokens == 0

    def remove_worker(self, worker_id: str) -> None:
        """Stop serving a worker (scaling down); requests still on it are re-driven."""
        self.lose(worker_id, "removed")
        self._disconnect(worker_id)
        del self.workers[worker_id]

    async def close(self) -> None:
        tasks = self._tasks + [task for _, task in self._links.values()]
        for task in self._tasks:
            task.cancel()
        for worker_id in list(self._links):
            self._disconnect(worker_id)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._reader is not None:
            self._reader.stop()
        if self._pull is not None:
            self._pull.close(linger=0)
        self._sync_ctx.term()

    async def _monitor_loop(self, worker: WorkerState, monitor: zmq.asyncio.Socket) -> None:
        """Connection events of the socket to `worker`: a drop means the process is gone
        (or its socket is); a new connection means something listens there again."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                worker.disconnected = True
                self.lose(worker.worker_id, "its control connection dropped")
            elif event == zmq.EVENT_CONNECTED:
                worker.disconnected = False

    async def _watch_loop(self) -> None:
        """Heartbeats: a worker silent for heartbeat_timeout_s is lost. Also re-sends Aborts
        a live worker has not acknowledged within that time."""
        interval_s = min(0.25, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            for queue in self._ticked.values():
                if queue.empty():
                    queue.put_nowait(TICK)
            now = self.clock()
            for worker in self.workers.values():
                silent_s = now - worker.last_seen
                if worker.ready and not worker.lost and silent_s > self.config.heartbeat_timeout_s:
                    self.lose(worker.worker_id, f"no heartbeat for {silent_s:.1f} s")
                heard = worker.last_seen > worker.hello_sent
                waited_s = now - worker.hello_sent
                if worker.ready is None and heard and waited_s > self.config.heartbeat_timeout_s:
                    self._hello(worker)
            for (worker_id, request_id), sent in list(self.unacked_releases.items()):
                if now - sent > self.config.heartbeat_timeout_s and self.is_healthy(worker_id):
                    log.warning("abort of %s on %s not acknowledged: resent", request_id, worker_id)
                    self.send(worker_id, messages.Abort(request_id))

    def lose(self, worker_id: str, reason: str) -> None:
        """Declare a worker dead now: its requests are gone (epoch bump) and every waiting
        driver hears it at once. It serves again once heard from (a new epoch)."""
        worker = self.workers[worker_id]
        if worker.lost:
            return
        log.warning("worker %s lost: %s", worker_id, reason)
        worker.lost = True
        worker.switching_to = None  # a restarted process announces its own role
        worker.epoch += 1
        worker.forget_requests()
        worker.cached_hashes.clear()
        for key in [k for k in self.unacked_releases if k[0] == worker_id]:
            del self.unacked_releases[key]  # its memory went with it
        for queue in self._queues.values():
            queue.put_nowait(WorkerLost(worker_id, reason))

    def _hello(self, worker: WorkerState) -> None:
        worker.hello_sent = self.clock()
        self.send(worker.worker_id, messages.Hello())

    def send(self, worker_id: str, message: Any) -> bool:
        """Queue `message` for a worker without blocking; False if it could not be queued."""
        try:
            self._pushes[worker_id].send(self._signer.encode(message), flags=zmq.NOBLOCK)
            if isinstance(message, (messages.Generate, messages.Prefill)):
                self.workers[worker_id].num_prompts_sent += 1
            if isinstance(message, messages.Abort):
                self.unacked_releases[(worker_id, message.request_id)] = self.clock()
            return True
        except (KeyError, zmq.ZMQError) as exc:
            log.error("cannot send %s to %s: %r", type(message).__name__, worker_id, exc)
            return False

    def switch_role(self, worker_id: str, role: str) -> bool:
        """Ask a worker to take `role`. It is not routed to from now on; it drains what it
        holds, switches and announces itself again (Ready), and is then routed by its new
        role. False when the worker is not healthy or already switching."""
        if role not in messages.ROLES:
            raise ValueError(f"role must be one of {messages.ROLES}, got {role!r}")
        worker = self.workers[worker_id]
        if worker.switching_to or not self.is_healthy(worker_id):
            return False
        worker.switching_to = role
        return self.send(worker_id, messages.SwitchRole(role))

    def open(self, request_id: str, tick: bool = False) -> asyncio.Queue[Any]:
        """The queue of `request_id`'s messages; with `tick`, a `TICK` is put into it each
        watch interval (at most every 0.25 s) that finds it empty."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        if tick:
            self._ticked[request_id] = queue
        return queue

    def close_request(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._ticked.pop(request_id, None)

    def _on_frame(self, frame: bytes) -> None:
        try:
            message = self._verifier.decode(frame)
        except messages.CodecError as exc:
            log.warning("dropped a control frame of %d bytes: %s", len(frame), exc)
            return
        try:
            self._dispatch(message)
        except Exception:  # one bad message must not stop the router hearing its workers
            log.exception("error handling %r", message)

    def _dispatch(self, message: Any) -> None:
        worker_id = getattr(message, "worker_id", "")
        worker = self.workers.get(worker_id)
        if worker is None:
            if worker_id not in self._unknown_logged:
                self._unknown_logged.add(worker_id)
                log.warning("message from unconfigured worker %r ignored", worker_id)
            return
        worker.last_seen = self.clock()
        if worker.lost and not worker.disconnected:
            log.info("worker %s is back", worker_id)
            worker.lost = False
        if isinstance(message, messages.Ready):
            self._on_ready(worker, message)
        if isinstance(message, (messages.Ready, messages.CoresSet, messages.StepReport)):
            if self.planner is not None:  # an adaptive deployment's
                self.planner.on_message(message)
        elif isinstance(message, messages.Stats):
            worker.on_stats(message)
            running = message.step_running_s
            worker.step_since = worker.last_seen - running if running > 0 else None
        elif isinstance(message, messages.KVEvents):
            worker.cached_hashes.update(message.stored)
            worker.cached_hashes.difference_update(message.removed)
        elif isinstance(message, messages.Released):
            self.unacked_releases.pop((worker_id, message.request_id), None)
            log.debug("worker %s released %s", worker_id, message.request_id)
        elif isinstance(message, _REQUEST_MESSAGES):
            queue = self._queues.get(message.request_id)
            if queue is None:
                log.debug("late %s for %s dropped", type(message).__name__, message.request_id)
            else:
                queue.put_nowait(message)
        else:
            log.warning("unexpected %s from worker %s", type(message).__name__, worker_id)

    def _on_ready(self, worker: WorkerState, message: messages.Ready) -> None:
        worker_id = worker.worker_id
        if message.hello and _same(worker.ready, message):
            # The answer to a Hello from the process this router knows: everything this router
            # sent it came after the Hello, so nothing was lost (no new epoch), and a switch in
            # progress goes on.
            if not worker.switching_to:
                worker.ready = message
        elif worker.switching_to and worker.ready:
            # The same process (a restart would have been lost first), done switching: its
            # requests were drained, its prefix cache stays, so no new epoch.
            log.info("worker %s switched to %s", worker_id, message.role)
            worker.ready, worker.switching_to = message, None
        else:
            if message.role != worker.endpoint.role:
                log.warning(
                    "worker %s announced role %s, configured as %s; using %s",
                    worker_id,
                    message.role,
                    worker.endpoint.role,
                    message.role,
                )
            worker.ready, worker.stats = message, None
            worker.cached_hashes.clear()
            worker.epoch += 1
            worker.forget_requests()
            log.info("worker %s ready: %s", worker_id, message)

    def is_healthy(self, worker_id: str, epoch: int | None = None) -> bool:
        """Ready, heard from within the heartbeat timeout, and (if given) not restarted."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.ready is None:
            return False
        if worker.lost or worker.disconnected or (epoch is not None and worker.epoch != epoch):
            return False
        return self.clock() - worker.last_seen <= self.config.heartbeat_timeout_s

    def step_running_s(self, worker_id: str) -> float | None:
        """How long the worker's engine step in progress has run, as its latest heartbeat says
        (None between steps)."""
        worker = self.workers.get(worker_id)
        since = worker.step_since if worker is not None else None
        return None if since is None else self.clock() - since

    def in_step_since(self, worker_id: str, deadline: float) -> bool:
        """Whether the worker is inside one engine step that began by `deadline` and has run
        less than `step_timeout_s`: a silence past `deadline` is then that step's."""
        running = self.step_running_s(worker_id)
        return (
            running is not None
            and self.clock() - running <= deadline
            and running < self.config.step_timeout_s
        )

    def loads(self, block_hashes: Sequence[int] = ()) -> list[WorkerLoad]:
        """Every worker's load; with `block_hashes`, also how long a prefix of them each
        worker holds in its cache (as its KVEvents told)."""
        out = []
        for w in self.workers.values():
            # Before its first Stats, a ready worker is idle with every block free.
            num_blocks = w.ready.num_blocks if w.ready else 0
            s = w.stats or messages.Stats(w.worker_id, w.role, 0, 0, num_blocks, 0, 0)
            num_cached = len(list(itertools.takewhile(w.cached_hashes.__contains__, block_hashes)))
            queued = s.num_queued_prefill_tokens + w.unseen_prompt_tokens
            out.append(
                WorkerLoad(
                    w.worker_id,
                    w.role,
                    self._routable(w),
                    s.num_waiting,
                    s.num_running,
                    s.num_free_blocks,
                    s.num_total_blocks,
                    queued,
                    w.active_requests,
                    num_cached,
                )
            )
        return out

    def _routable(self, worker: WorkerState) -> bool:
        healthy = self.is_healthy(worker.worker_id)
        return healthy and worker.switching_to is None and not worker.retiring

    def healthy_ids(self, role: str) -> set[str]:
        return {w for w, x in self.workers.items() if x.role == role and self.is_healthy(w)}

    def healthy_roles(self) -> set[str]:
        """The roles new requests can be routed to now."""
        return {w.role for w in self.workers.values() if self._routable(w)}

    def switching(self, role: str) -> bool:
        """Whether a healthy worker of `role` is switching away from it."""
        return any(
            w.switching_to and w.role == role and self.is_healthy(w.worker_id)
            for w in self.workers.values()
        )

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when every role the workers have has at least one routable worker."""
        needed = {w.role for w in self.workers.values()}
        missing = sorted(needed - self.healthy_roles())
        ok = bool(needed) and not missing
        workers = {
            w_id: {"role": w.role, "ready": w.ready is not None, "healthy": self.is_healthy(w_id)}
            for w_id, w in self.workers.items()
        }
        missing_roles = missing if needed else ["any worker (none configured)"]
        status = "ok" if ok else "unavailable"
        return ok, {"status": status, "missing_roles": missing_roles, "workers": workers}

    def max_model_len(self) -> int | None:
        """The smallest context limit among ready workers: a prompt must fit all of them."""
        lens = [w.ready.max_model_len for w in self.workers.values() if w.ready]
        return min(lens) if lens else None


def _same(known: messages.Ready | None, ready: messages.Ready) -> bool:
    return known is not None and bool(ready.incarnation) and known.incarnation == ready.incarnation
