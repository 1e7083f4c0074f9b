"""What the router knows of one worker (the control plane's table row), and the event a lost
worker puts into request queues."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import messages
from pdserve.router.config import WorkerEndpoint


@dataclass
class WorkerLost:
    """Put into request queues when a worker is lost (not a wire message)."""

    worker_id: str
    reason: str


@dataclass
class WorkerState:
    endpoint: WorkerEndpoint
    ready: messages.Ready | None = None
    stats: messages.Stats | None = None
    last_seen: float = 0.0
    epoch: int = 0  # +1 per Ready: a re-announced worker has lost its earlier requests
    sent_prefill_tokens: int = 0  # prompt tokens sent, first token not yet back
    active_requests: int = 0  # requests the router has on this worker now
    lost: bool = False  # declared dead; cleared when it is heard from (or reconnects) again
    disconnected: bool = False  # its control connection dropped and has not come back
    cached_hashes: set[int] = field(default_factory=set)  # its prefix cache, from KVEvents
    switching_to: str | None = None  # asked to switch roles: not routed to until Ready
    hello_sent: float = 0.0  # when it was last sent Hello (it is sent until a Ready comes)
    retiring: bool = False  # about to be removed: not routed to, finishes what it holds

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def role(self) -> str:
        return self.ready.role if self.ready else self.endpoint.role
