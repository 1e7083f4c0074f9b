"""The two halves of disaggregation inside one engine: a prefill engine hands a request's
KV to a decode engine's reserved blocks. Both are request states on top of the ordinary
scheduler, not a second engine (DESIGN.md §2). The decode half's code is in
engine/decode_handoff.py (re-exported here).

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

A prompt over the decode worker's KV budget is dropped before the transfer (PromptDrop,
kvcache/dropping.py): the decode worker reserves only the blocks it keeps, without its prefix
cache; the prefill worker computes the prompt's block scores, and after the last chunk sends
just the kept blocks, in order, in one send (layer-wise sending cannot know the victims before
every layer has run); the first token then travels with the number of dropped tokens and the
kept blocks' scores, from which the decode worker's own dropping continues.

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

from pdserve.engine.decode_handoff import (  # re-exported: the two halves live here
    LAND_TIMEOUT_S,
    RESERVE_TIMEOUT_S,
    DecodeHandoff,
    KVReservation,
)
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager, cdiv
from pdserve.request import Request, RequestStatus
from pdserve.transfer.base import KVSender, TransferStatus

log = logging.getLogger(__name__)

__all__ = [
    "LAND_TIMEOUT_S",
    "RESERVE_TIMEOUT_S",
    "DecodeHandoff",
    "KVReservation",
    "PrefillHandoff",
    "KVDestination",
]

TRANSFER_MODES = ("layerwise", "full")
SEND_TIMEOUT_S = 5.0


@dataclass
class KVDestination:
    peer: dict[str, Any]  # the decode worker's receiver address
    block_ids: list[int]  # its reserved blocks, one per prompt block
    # Full blocks already sent or never to be sent (the decode side's cached prefix, first).
    # Only ever grows.
    num_sent_full_blocks: int = 0
    num_skip_blocks: int = 0  # leading blocks the decode worker already holds
    drop: PromptDrop | None = None  # send only the kept blocks, after the last chunk
    kept_scores: list[float] | None = None  # the kept blocks' scores, once chosen


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
        # A request's per-block attention scores (the model runner's): ranks dropped prompts.
        self.scores_of: Callable[[Request], list[float]] | None = None

    def add(
        self,
        request: Request,
        peer: dict[str, Any],
        block_ids: list[int],
        skip_blocks: int = 0,
        drop: PromptDrop | None = None,
    ) -> None:
        """Send the prompt's KV into `block_ids` at `peer`, except the first `skip_blocks`
        (the decode worker's own cached prefix). The last block is always sent: a prefix hit
        never covers a whole prompt, and the final send is what completes the transfer.
        With `drop`, only the kept blocks are sent, one per destination block."""
        needed = cdiv(request.num_prompt_tokens, self.kv.block_size)
        if drop is not None:
            if skip_blocks:
                raise ValueError("a dropped prompt is reserved without cached blocks to skip")
            if drop.num_keep_blocks >= needed:
                raise ValueError(
                    f"keeping {drop.num_keep_blocks} of {needed} prompt blocks drops nothing"
                )
            needed = drop.num_keep_blocks
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
            peer, list(block_ids), skip_blocks, skip_blocks, drop
        )
        request.kv_keep_blocks = drop.num_keep_blocks if drop else None  # scores it

    def plan(self, out: SchedulerOutput) -> list[_Send]:
        """The blocks each scheduled prefill chunk completes, from the first not yet sent
        (so this worker's own prefix-cache hit goes too, unless the decode worker holds it).

        A middle chunk sends only full blocks: the next chunk writes into a partial one,
        and a send still reading it would see it change (tcp's checksum fails the request,
        a shm copy tears). The last chunk sends its partial block. A middle chunk inside
        the decode worker's cached prefix sends nothing. A dropped prompt sends nothing
        until its last chunk, then everything it keeps (`after_step`)."""
        sends = []
        for request, num_new in out.scheduled:
            dest = self.destinations.get(request.request_id)
            if dest is None:
                continue
            end = request.num_computed_tokens + num_new
            last = end >= request.num_prompt_tokens
            if dest.drop is not None:
                if last:
                    sends.append(_Send(request, dest, [], [], True))
                continue
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
        sends = [s for s in sends if s.dest.drop is None]
        if self.mode != "layerwise" or not sends:
            return None
        final = self.num_layers - 1

        def on_layer_done(layer: int) -> None:
            for s in sends:
                self._send(s, [layer], s.last and layer == final)

        return on_layer_done

    def after_step(self, sends: list[_Send]) -> None:
        """Full mode: one send of every layer once the whole prompt is computed (all but
        the blocks the decode worker already holds). A dropped prompt, in either mode: one
        send of the blocks it keeps, now that every layer's scores exist."""
        for s in sends:
            if s.dest.drop is not None:
                self._send_kept(s)
            elif s.last and self.mode == "full":
                skip, num_blocks = s.dest.num_skip_blocks, len(s.dest.block_ids)
                src = s.request.block_ids[skip:num_blocks]
                dst = s.dest.block_ids[skip:]
                self._send(_Send(s.request, s.dest, src, dst, True), self._all_layers(), True)

    def _send_kept(self, s: _Send) -> None:
        """The kept blocks, in order, into the destination blocks (as many as kept)."""
        scores = self.scores_of(s.request)
        kept = s.dest.drop.kept(scores)
        s.dest.kept_scores = [float(scores[i]) for i in kept]
        src = [s.request.block_ids[i] for i in kept]
        self._send(_Send(s.request, s.dest, src, s.dest.block_ids, True), self._all_layers(), True)

    def _all_layers(self) -> list[int]:
        return list(range(self.num_layers))

    def dropped(self, request: Request) -> tuple[int, list[float] | None]:
        """What the decode worker needs with the first token: the number of prompt tokens
        dropped before the transfer and the kept blocks' scores (0 and None: no drop)."""
        dest = self.destinations.get(request.request_id)
        if dest is None or dest.drop is None:
            return 0, None
        bs = self.kv.block_size
        return dest.drop.num_dropped_tokens(request.num_prompt_tokens, bs), dest.kept_scores

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
