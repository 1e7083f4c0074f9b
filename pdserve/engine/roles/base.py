"""The role interface: what a collocated, prefill or decode engine adds to the ordinary
scheduler loop. An engine holds exactly one role object; `Engine.switch_role` replaces it
between requests.

Contract, per engine step (engine.py)::

    role.plan(out)          before the model runs: what the step's chunks send; returns a
                            per-layer hook (layer-wise sends) or None
    runner.execute(out, hook)
    role.after_step()       after the model ran: sends that need every layer (or scores)
    role.on_finished(r)     for each request the scheduler finished this step or aborted

and between steps `poll()` (transfers that completed or failed, deadlines), `abort(id)`.

Invariants every role keeps:
  - A block a transfer may still read or write is never freed: a prefill-only request the
    scheduler finished keeps its blocks until its sends end (`on_finished`); a decode
    reservation is released in the receiver before its blocks are freed.
  - `num_in_flight()` counts the requests the role holds outside the scheduler (sending,
    awaiting KV); the engine switches roles only when it and the scheduler are empty.
  - Requests a role cannot take (a Reserve on a prefill engine) are refused with
    ValueError naming the role, before any state changes (a first token for a reservation
    it does not hold: KeyError).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvcache.dropping import PromptDrop
from pdserve.request import Request


@dataclass(frozen=True)
class KVReservation:
    """A decode worker's blocks for one prompt, one per prompt block::

        block_ids:  [ c0 c1 c2 | n0 n1 n2 n3 ]
                     cached      new: expected from the prefill worker
                     (num_cached_blocks)

    The cached blocks are the decode worker's own prefix-cache hit: shared, ref-counted,
    already holding this prefix's KV, so they are never written and never sent. With `drop`
    (a prompt over budget) there are only `drop.num_keep_blocks` blocks and no cached ones."""

    block_ids: list[int]
    num_cached_blocks: int = 0
    drop: PromptDrop | None = None


@dataclass(frozen=True)
class KVDestination:
    """Where a prompt's KV goes: the decode worker's receiver and its reserved blocks, one
    per prompt block (with `drop`, one per kept block). The first `num_cached_blocks` hold
    the decode worker's own cached prefix: never sent."""

    peer: dict[str, Any]
    block_ids: list[int]
    num_cached_blocks: int = 0
    drop: PromptDrop | None = None


class Role:
    name: ClassVar[str]
    # The prefill role reserves a prompt's blocks on admission: a running prefill is never
    # preempted, since a transfer may be reading its blocks.
    preallocate_prompt: ClassVar[bool] = False
    # A pinned warm-up leaves the prompt in this engine's cache for later requests here;
    # a decode engine never prefills its own requests' prompts, so pins there are refused.
    takes_pins: ClassVar[bool] = True

    def plan(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """Before the step runs; returns a hook called after each layer, or None."""
        return None

    def after_step(self) -> None:
        """After the step ran (every layer's KV and scores exist)."""

    def on_finished(self, request: Request) -> None:
        """The scheduler finished `request` (any reason). A prefill-only request's blocks
        are still held and are this role's to free."""

    def poll(self) -> list[tuple[str, str]]:
        """Advance transfers and deadlines; (request id, error) of each failed request."""
        return []

    def abort(self, request_id: str) -> bool:
        """Stop whatever the role holds of the request; True if it held it outside the
        scheduler (the scheduler's part is the engine's)."""
        return False

    def num_in_flight(self) -> int:
        return 0

    def request_ids(self) -> list[str]:
        """The requests this role holds outside the scheduler."""
        return []

    def transfer_stats(self) -> dict[str, Any]:
        """Cumulative counters, named as `messages.Stats` names them."""
        return {}

    # ---- entry points of the disaggregated roles (refused by the others) ---------------

    def add_prefill(self, request: Request, destination: KVDestination) -> None:
        raise ValueError(f"a {self.name} worker does not take Prefill (a prefill worker does)")

    def reserve(self, request: Request, drop: PromptDrop | None) -> KVReservation | None:
        raise ValueError(f"a {self.name} worker does not take Reserve (a decode worker does)")

    def start(self, request_id: str, first_token_id: int) -> None:
        """KeyError, as for a reservation that is gone."""
        raise KeyError(f"no reservation for request {request_id!r}: this is a {self.name} worker")
