"""The two halves of disaggregation inside one engine: a prefill engine hands a request's
KV to a decode engine's reserved blocks. Both are request states on top of the ordinary
scheduler, not a second engine (DESIGN.md §2).

Prefill side, per request:   RUNNING (chunks; the blocks each completes are sent, but not
                                     those the decode worker already holds)
                             -> SENDING_KV (first token out; blocks pinned)
                             -> blocks freed (or kept as prefix cache) once the sender
                                reports DONE or FAILED — never while it may still read them.
Decode side, per request:    WAITING_FOR_KV (blocks reserved: the prompt's prefix this
                                worker already caches is shared, the rest is new and only
                                the new blocks are expected from the prefill worker)
                             -> RUNNING once both the KV has landed and the first token is
                                known; the reservation is released so no late write lands.

Deadlines bound every wait on a peer, so a dead or stuck peer (or a lost message) costs
seconds, never blocks forever (each failure is reported to the router as `Failed`):
  - SENDING_KV longer than `send_timeout_s` (after the first token): the send is aborted
    and the blocks are freed once the sender confirms it stopped reading them.
  - WAITING_FOR_KV longer than `reserve_timeout_s` after Reserve (no prefill ever came:
    the router or the prefill worker is gone), or than `land_timeout_s` after StartDecode
    (the prefill is done, only bytes in flight remain): the reservation is released (no
    late write can land after that) and its blocks freed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.manager import KVCacheManager, cdiv
from pdserve.request import Request, RequestStatus
from pdserve.transfer.base import KVReceiver, KVSender, TransferStatus

log = logging.getLogger(__name__)

TRANSFER_MODES = ("layerwise", "full")
SEND_TIMEOUT_S = 5.0
# Covers the whole prefill queue (minutes when a CPU prefill worker is saturated); a dead
# prefill worker is noticed by the router long before this, from its heartbeats.
RESERVE_TIMEOUT_S = 600.0
LAND_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KVReservation:
    """A decode worker's blocks for one prompt, one per prompt block::

        block_ids:  [ c0 c1 c2 | n0 n1 n2 n3 ]
                     cached      new: expected from the prefill worker
                     (num_cached_blocks)

    The cached blocks are the decode worker's own prefix-cache hit: shared, ref-counted,
    already holding this prefix's KV, so they are never written and never sent."""

    block_ids: list[int]
    num_cached_blocks: int = 0


@dataclass
class KVDestination:
    peer: dict[str, Any]  # the decode worker's receiver address
    block_ids: list[int]  # its reserved blocks, one per prompt block
    # Full blocks already sent or never to be sent (the decode side's cached prefix, first).
    # Only ever grows.
    num_sent_full_blocks: int = 0
    num_skip_blocks: int = 0  # leading blocks the decode worker already holds


@dataclass
class _Send:
    request: Request
    dest: KVDestination
    src: list[int]
    dst: list[int]
    last: bool


class PrefillHandoff:
    def __init__(
        self,
        sender: KVSender,
        kv: KVCacheManager,
        num_layers: int,
        mode: str,
        send_timeout_s: float = SEND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer mode must be one of {TRANSFER_MODES}, got {mode!r}")
        self.sender, self.kv, self.num_layers, self.mode = sender, kv, num_layers, mode
        self.send_timeout_s, self.clock = send_timeout_s, clock
        self.destinations: dict[str, KVDestination] = {}
        self.sending: dict[str, Request] = {}  # SENDING_KV: blocks pinned until sends end
        self._send_deadlines: dict[str, float] = {}
        self._expired: dict[str, str] = {}  # aborted for their deadline: the error to report
        # Set when the decode side's KV dtype differs: re-encodes blocks into the tensor the
        # sender reads, so conversion happens before the wire (fewer bytes, and shm's
        # one-sided writes leave the receiver no chance to convert).
        self.convert: Callable[[list[int], list[int]], None] | None = None

    def add(
        self, request: Request, peer: dict[str, Any], block_ids: list[int], skip_blocks: int = 0
    ) -> None:
        """Send the prompt's KV into `block_ids` at `peer`, except the first `skip_blocks`
        (the decode worker's own cached prefix). The last block is always sent: a prefix hit
        never covers a whole prompt, and the final send is what completes the transfer."""
        needed = cdiv(request.num_prompt_tokens, self.kv.block_size)
        if len(block_ids) != needed:
            raise ValueError(f"got {len(block_ids)} destination blocks for {needed} prompt blocks")
        if isinstance(skip_blocks, bool) or not isinstance(skip_blocks, int):
            raise ValueError(f"kv_skip_blocks must be an int, got {skip_blocks!r}")
        max_skip = (request.num_prompt_tokens - 1) // self.kv.block_size
        if not 0 <= skip_blocks <= max_skip:
            raise ValueError(
                f"kv_skip_blocks {skip_blocks} outside 0..{max_skip} for a prompt of "
                f"{request.num_prompt_tokens} tokens (the block with the last token is sent)"
            )
        self.destinations[request.request_id] = KVDestination(
            peer, list(block_ids), num_sent_full_blocks=skip_blocks, num_skip_blocks=skip_blocks
        )

    def plan(self, out: SchedulerOutput) -> list[_Send]:
        """The blocks each scheduled prefill chunk completes, from the first not yet sent
        (so this worker's own prefix-cache hit goes too, unless the decode worker holds it).

        A middle chunk sends only full blocks: the next chunk writes into a partial one,
        and a send still reading it would see it change (tcp's checksum fails the request,
        a shm copy tears). The last chunk sends its partial block. A middle chunk inside
        the decode worker's cached prefix sends nothing."""
        sends = []
        for request, num_new in out.scheduled:
            dest = self.destinations.get(request.request_id)
            if dest is None:
                continue
            end = request.num_computed_tokens + num_new
            last = end >= request.num_prompt_tokens
            first = dest.num_sent_full_blocks
            stop = cdiv(end, self.kv.block_size) if last else end // self.kv.block_size
            dest.num_sent_full_blocks = max(first, end // self.kv.block_size)
            if first >= stop and not last:
                continue
            src, dst = request.block_ids[first:stop], dest.block_ids[first:stop]
            sends.append(_Send(request, dest, src, dst, last))
        return sends

    def layer_hook(self, sends: list[_Send]) -> Callable[[int], None] | None:
        """Layer-wise mode: send layer i's blocks while layer i+1 computes."""
        if self.mode != "layerwise" or not sends:
            return None
        final = self.num_layers - 1

        def on_layer_done(layer: int) -> None:
            for s in sends:
                self._send(s, [layer], s.last and layer == final)

        return on_layer_done

    def after_step(self, sends: list[_Send]) -> None:
        """Full mode: one send of every layer once the whole prompt is computed (all but
        the blocks the decode worker already holds)."""
        if self.mode != "full":
            return
        for s in sends:
            if s.last:
                skip, num_blocks = s.dest.num_skip_blocks, len(s.dest.block_ids)
                src = s.request.block_ids[skip:num_blocks]
                dst = s.dest.block_ids[skip:]
                self._send(
                    _Send(s.request, s.dest, src, dst, True), list(range(self.num_layers)), True
                )

    def _send(self, s: _Send, layers: list[int], last: bool) -> None:
        if s.request.request_id not in self.destinations:
            return  # aborted: the sender already stopped it
        if self.convert is not None:  # the decode side stores another KV dtype
            self.convert(layers, s.src)
        self.sender.send(s.dest.peer, s.request.request_id, layers, s.src, s.dst, last)

    def on_finished(self, request: Request) -> None:
        """The scheduler is done with a prefill request; keep its blocks until sent."""
        if request.request_id in self.destinations:
            log.debug("prefill %s: running -> sending_kv", request.request_id)
            request.status = RequestStatus.SENDING_KV
            self.sending[request.request_id] = request
            self._send_deadlines[request.request_id] = self.clock() + self.send_timeout_s
        else:
            self.kv.free(request)

    def poll(self) -> list[tuple[str, str | None]]:
        """Free the blocks of finished sends, abort sends past their deadline; returns
        (request id, error or None) per finished send."""
        now = self.clock()
        for request_id in [r for r, t in self._send_deadlines.items() if t <= now]:
            del self._send_deadlines[request_id]
            self._expired[request_id] = f"KV send not acknowledged within {self.send_timeout_s} s"
            log.warning("prefill %s: %s; aborting it", request_id, self._expired[request_id])
            self.abort(request_id)
        results = []
        for request_id, status, error in self.sender.pop_finished():
            self.destinations.pop(request_id, None)
            self._send_deadlines.pop(request_id, None)
            request = self.sending.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.FINISHED
                self.kv.free(request)
            ok = status is TransferStatus.DONE
            error = self._expired.pop(request_id, None) or error or "KV transfer failed"
            log.debug("prefill %s: sending_kv -> %s", request_id, "done" if ok else error)
            results.append((request_id, None if ok else error))
        return results

    def abort(self, request_id: str) -> None:
        """Stop sending. If bytes may already be moving, the blocks are freed only when the
        sender confirms it stopped reading them (`poll`); otherwise at once."""
        if request_id not in self.destinations:
            return
        try:
            self.sender.status(request_id)
        except KeyError:  # nothing was ever sent
            del self.destinations[request_id]
            self._send_deadlines.pop(request_id, None)
            self._expired.pop(request_id, None)
            request = self.sending.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.FINISHED
                self.kv.free(request)
            return
        self.sender.abort(request_id)


class DecodeHandoff:
    def __init__(
        self,
        receiver: KVReceiver,
        scheduler: Scheduler,
        kv: KVCacheManager,
        reserve_timeout_s: float = RESERVE_TIMEOUT_S,
        land_timeout_s: float = LAND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.receiver, self.scheduler, self.kv = receiver, scheduler, kv
        self.reserve_timeout_s, self.land_timeout_s = reserve_timeout_s, land_timeout_s
        self.clock = clock
        self.awaiting: dict[str, Request] = {}  # WAITING_FOR_KV
        self.landed: set[str] = set()
        self.first_tokens: dict[str, int] = {}
        self._deadlines: dict[str, tuple[float, str]] = {}  # request id -> (when, what)
        self.num_skipped_blocks = 0  # prompt blocks reserved from the own prefix cache

    def reserve(self, request: Request) -> KVReservation | None:
        """Blocks for the prompt's KV, or None when they do not fit right now.

        The prompt's longest prefix this worker already caches is taken by reference (its
        blocks are shared and only read); the receiver expects just the new blocks, so a
        write into a shared cached block is rejected by the transfer layer."""
        hits = self.kv.find_cached_prefix(request)
        num_new_tokens = request.num_prompt_tokens - len(hits) * self.kv.block_size
        if not self.kv.allocate(request, num_new_tokens, hits):
            return None
        try:
            self.receiver.expect(request.request_id, request.block_ids[len(hits) :])
        except ValueError:
            self.kv.free(request)  # the hit's references too
            raise
        request.status = RequestStatus.WAITING_FOR_KV
        self.awaiting[request.request_id] = request
        when = self.clock() + self.reserve_timeout_s
        self._deadlines[request.request_id] = (when, f"no KV within {self.reserve_timeout_s} s")
        self.num_skipped_blocks += len(hits)
        log.debug("decode %s: -> waiting_for_kv (%d cached blocks)", request.request_id, len(hits))
        return KVReservation(list(request.block_ids), len(hits))

    def start(self, request_id: str, first_token_id: int) -> None:
        if request_id not in self.awaiting:
            raise KeyError(f"no reservation for request {request_id!r}")
        self.first_tokens[request_id] = first_token_id
        what = f"KV did not land within {self.land_timeout_s} s of the first token"
        self._deadlines[request_id] = (self.clock() + self.land_timeout_s, what)
        self._activate_if_ready(request_id)

    def poll(self) -> list[tuple[str, str]]:
        """Activate requests whose KV landed; returns (request id, error) of failed ones
        (transfer errors and reservations past their deadline)."""
        failed = []
        now = self.clock()
        for request_id, (when, what) in list(self._deadlines.items()):
            if when <= now and request_id in self.awaiting:
                log.warning("decode %s: %s; releasing its blocks", request_id, what)
                self._drop(request_id)
                failed.append((request_id, what))
        for request_id, status, error in self.receiver.pop_finished():
            if request_id not in self.awaiting:
                continue
            if status is TransferStatus.DONE:
                self.landed.add(request_id)
                self._activate_if_ready(request_id)
            else:
                self._drop(request_id)
                failed.append((request_id, error or "KV transfer failed"))
        return failed

    def abort(self, request_id: str) -> bool:
        if request_id not in self.awaiting:
            return False
        self._drop(request_id)
        return True

    def _activate_if_ready(self, request_id: str) -> None:
        if request_id not in self.landed or request_id not in self.first_tokens:
            return
        request = self.awaiting.pop(request_id)
        self._deadlines.pop(request_id, None)
        log.debug("decode %s: waiting_for_kv -> running", request_id)
        self.landed.discard(request_id)
        request.output_token_ids.append(self.first_tokens.pop(request_id))
        request.num_computed_tokens = request.num_prompt_tokens
        self.receiver.release(request_id)
        self.kv.cache_computed_blocks(request)
        self.scheduler.add_running(request)

    def _drop(self, request_id: str) -> None:
        request = self.awaiting.pop(request_id)
        self._deadlines.pop(request_id, None)
        log.debug("decode %s: waiting_for_kv -> finished (blocks freed)", request_id)
        self.receiver.release(request_id)  # returns only once no write can land any more
        self.landed.discard(request_id)
        self.first_tokens.pop(request_id, None)
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
