"""The worker table and the control-plane sockets.

    workers ──PUSH──▶ [router PULL, bound at ctrl_address]   Ready, Stats, Tokens, ...
    router  ──PUSH──▶ [worker PULL, one per worker]          Generate, Reserve, Abort, ...

Incoming messages are dispatched by request_id to the per-request asyncio queue a driver
opened; Ready and Stats update the table. Sends are synchronous non-blocking ZMQ calls, so an
Abort can be sent from a `finally` during task cancellation without awaiting anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from pdserve import messages
from pdserve.router.config import RouterConfig, WorkerEndpoint
from pdserve.router.policies import WorkerLoad

log = logging.getLogger(__name__)

_REQUEST_MESSAGES = (messages.Reserved, messages.Rejected, messages.Tokens, messages.Failed)


@dataclass
class WorkerState:
    endpoint: WorkerEndpoint
    ready: messages.Ready | None = None
    stats: messages.Stats | None = None
    last_seen: float = 0.0
    epoch: int = 0  # +1 per Ready: a re-announced worker has lost its earlier requests
    sent_prefill_tokens: int = 0  # prompt tokens sent, first token not yet back
    active_requests: int = 0  # requests the router has on this worker now

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def role(self) -> str:
        return self.ready.role if self.ready else self.endpoint.role


class ControlPlane:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.workers = {w.worker_id: WorkerState(w) for w in config.workers}
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._async_ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._pull: zmq.asyncio.Socket | None = None
        self._pushes: dict[str, zmq.Socket] = {}
        self._recv_task: asyncio.Task[None] | None = None
        self._unknown_logged: set[str] = set()

    async def start(self) -> None:
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.config.ctrl_address)
        for worker in self.workers.values():
            push = self._sync_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.connect(worker.endpoint.address)
            self._pushes[worker.worker_id] = push
        self._recv_task = asyncio.create_task(self._recv_loop(), name="router-ctrl-recv")

    async def close(self) -> None:
        if self._recv_task:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        for sock in [self._pull, *self._pushes.values()]:
            if sock is not None:
                sock.close(linger=0)
        self._async_ctx.term()
        self._sync_ctx.term()

    # ---- sending ------------------------------------------------------------------------

    def send(self, worker_id: str, message: Any) -> bool:
        """Queue `message` for a worker without blocking; False if it could not be queued."""
        try:
            self._pushes[worker_id].send(
                messages.encode(message, self.config.secret), flags=zmq.NOBLOCK
            )
            return True
        except (KeyError, zmq.ZMQError) as exc:
            log.error("cannot send %s to %s: %r", type(message).__name__, worker_id, exc)
            return False

    def shutdown_workers(self) -> None:
        for worker_id in self._pushes:
            self.send(worker_id, messages.Shutdown())

    # ---- per-request queues -------------------------------------------------------------

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close_request(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            frame = await self._pull.recv()
            try:
                message = messages.decode(frame, self.config.secret)
            except messages.CodecError as exc:
                log.warning("dropped a control frame of %d bytes: %s", len(frame), exc)
                continue
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
        if isinstance(message, messages.Ready):
            if message.role != worker.endpoint.role:
                log.warning(
                    "worker %s announced role %s, configured as %s; using %s",
                    worker_id, message.role, worker.endpoint.role, message.role,
                )  # fmt: skip
            worker.ready, worker.stats = message, None
            worker.epoch += 1
            worker.sent_prefill_tokens = worker.active_requests = 0
            log.info("worker %s ready: %s", worker_id, message)
        elif isinstance(message, messages.Stats):
            worker.stats = message
        elif isinstance(message, _REQUEST_MESSAGES):
            queue = self._queues.get(message.request_id)
            if queue is None:
                log.debug("late %s for %s dropped", type(message).__name__, message.request_id)
            else:
                queue.put_nowait(message)
        else:
            log.warning("unexpected %s from worker %s", type(message).__name__, worker_id)

    # ---- table queries ------------------------------------------------------------------

    def is_healthy(self, worker_id: str, epoch: int | None = None) -> bool:
        """Ready, heard from within the heartbeat timeout, and (if given) not restarted."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.ready is None:
            return False
        if epoch is not None and worker.epoch != epoch:
            return False
        return self.clock() - worker.last_seen <= self.config.heartbeat_timeout_s

    def loads(self) -> list[WorkerLoad]:
        out = []
        for w in self.workers.values():
            s = w.stats
            out.append(
                WorkerLoad(
                    worker_id=w.worker_id,
                    role=w.role,
                    healthy=self.is_healthy(w.worker_id),
                    num_waiting=s.num_waiting if s else 0,
                    num_running=s.num_running if s else 0,
                    num_free_blocks=s.num_free_blocks
                    if s
                    else (w.ready.num_blocks if w.ready else 0),
                    num_total_blocks=s.num_total_blocks if s else 0,
                    num_queued_prefill_tokens=(s.num_queued_prefill_tokens if s else 0)
                    + w.sent_prefill_tokens,
                    num_active_requests=w.active_requests,
                )
            )
        return out

    def healthy_roles(self) -> set[str]:
        return {w.role for w in self.workers.values() if self.is_healthy(w.worker_id)}

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when every configured role has at least one ready, live worker."""
        needed = {w.endpoint.role for w in self.workers.values()}
        missing = sorted(needed - self.healthy_roles())
        ok = bool(needed) and not missing
        detail: dict[str, Any] = {
            "status": "ok" if ok else "unavailable",
            "missing_roles": missing if needed else ["any worker (none configured)"],
            "workers": {
                w.worker_id: {
                    "role": w.role,
                    "ready": w.ready is not None,
                    "healthy": self.is_healthy(w.worker_id),
                }
                for w in self.workers.values()
            },
        }
        return ok, detail

    def max_model_len(self) -> int | None:
        """The smallest context limit among ready workers: a prompt must fit all of them."""
        lens = [w.ready.max_model_len for w in self.workers.values() if w.ready]
        return min(lens) if lens else None
