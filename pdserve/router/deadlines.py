"""How long one request may wait on its workers, router-side.

A worker's heartbeat comes from its own thread, so an engine loop that is frozen (a deadlock,
a hung kernel) still looks alive: without these bounds a request on it would hang forever.
A worker that misses a deadline is treated as lost for that request: the attempt is aborted
and re-driven elsewhere (the driver's `Lost` path), and the worker is not picked again for
it (it may be frozen for every request).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.config import RouterConfig


class Lost(Exception):
    """The current attempt cannot finish (a worker died, failed, or missed a deadline)."""


@dataclass(frozen=True)
class Deadlines:
    admission_s: float  # a worker with room (Reserve / Generate accepted)
    first_token_s: float  # dispatch -> the worker's first Tokens (queue wait + prefill)
    token_s: float  # between two Tokens of the same worker
    max_recoveries: int  # re-drives after failures and missed deadlines, then 502

    @classmethod
    def of(cls, config: RouterConfig) -> Deadlines:
        return cls(
            config.admission_timeout_s,
            config.first_token_timeout_s,
            config.token_timeout_s,
            config.max_recoveries,
        )

    def watch(self, worker_id: str, first_token: bool) -> Watch:
        if first_token:
            return Watch(worker_id, self.first_token_s, "first_token_timeout_s")
        return Watch(worker_id, self.token_s, "token_timeout_s")


@dataclass(frozen=True)
class Watch:
    """The one worker a wait is for, and how long it may stay silent."""

    worker_id: str
    timeout_s: float
    field: str  # the RouterConfig field, named in the error

    def lost(self) -> Lost:
        return Lost(f"worker {self.worker_id} sent nothing for {self.timeout_s:g} s ({self.field})")
