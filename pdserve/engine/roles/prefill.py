"""The prefill role: compute a prompt, stream its KV into a decode worker's reserved blocks,
sample the first token; the blocks are freed once the sender is done reading them.

One request::

    RUNNING (chunks; each sends the blocks it completes, except those the decode worker
             already holds)
      -> SENDING_KV (first token out; blocks held)
      -> blocks freed (or kept as prefix cache) once the sender reports DONE or FAILED,
         never while it may still read them; past `send_timeout_s` the send is aborted.

A prompt over the decode worker's KV budget (`KVDestination.drop`, chosen by the decode
worker) is scored by the model runner and, after its last chunk, only the kept blocks are
sent, in order, in one send (layer-wise sending cannot know the victims before every layer
has run), which carries the number of dropped tokens and the kept blocks' scores to the
decode worker (the transfer's `meta`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.roles.base import KVDestination, Role
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.manager import KVCacheManager, cdiv
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.transfer import TRANSFER_MODES, KVTransferConfig
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.sender import SocketKVSender

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = KVTransferConfig().send_timeout_s  # the knob's default (--transfer-send-timeout-s)


@dataclass
class _Handoff:
    """One request's send, from admission until the sender lets go of its blocks."""

    request: Request
    dest: KVDestination
    # Full blocks already sent or never to be sent (the decode side's cached prefix first).
    # Only ever grows.
    num_sent_full_blocks: int
    send_deadline: float | None = None  # SENDING_KV: abort the send after this
    error: str | None = None  # aborted for its deadline: the error to report


@dataclass
class _Send:
    handoff: _Handoff
    src: list[int]
    dst: list[int]
    last: bool


class PrefillRole(Role):
    name = "prefill"
    preallocate_prompt = True

    def __init__(
        self,
        sender: SocketKVSender,
        scheduler: Scheduler,
        kv: KVCacheManager,
        num_layers: int,
        mode: str,
        scores_of: Callable[[Request], list[float]],
        convert: Callable[[list[int], list[int]], None] | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`scores_of`: a request's per-block attention scores (ranks dropped prompts).
        `convert`: re-encodes blocks into the tensor the sender reads, when the decode side
        stores another KV dtype (converting before the wire moves fewer bytes, and shm's
        one-sided writes leave the receiver no chance to convert)."""
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer mode must be one of {TRANSFER_MODES}, got {mode!r}")
        self.sender, self.scheduler, self.kv = sender, scheduler, kv
        self.num_layers, self.mode = num_layers, mode
        self.scores_of, self.convert = scores_of, convert
        self.send_timeout_s, self.clock = send_timeout_s, clock
        self.handoffs: dict[str, _Handoff] = {}
        # Failed sends by reason (send_timeout, send_failed), the router's aborts left out.
        self.transfer_failures = collections.Counter[str]()
        self._sends: list[_Send] = []  # this step's

    def add_prefill(self, request: Request, destination: KVDestination) -> None:
        """Send the prompt's KV to `destination`, except its cached blocks. The last block is
        always sent: a prefix hit never covers a whole prompt, and the final send is what
        completes the transfer. With `drop`, only the kept blocks are sent."""
        dest, bs = destination, self.kv.block_size
        needed = cdiv(request.num_prompt_tokens, bs)
        if dest.drop is not None:
            if dest.num_cached_blocks:
                raise ValueError("a dropped prompt is reserved without cached blocks to skip")
            if dest.drop.num_keep_blocks >= needed:
                raise ValueError(
                    f"keeping {dest.drop.num_keep_blocks} of {needed} prompt blocks drops nothing"
                )
            needed = dest.drop.num_keep_blocks
        if len(dest.block_ids) != needed:
            raise ValueError(
                f"got {len(dest.block_ids)} destination blocks for {needed} prompt blocks"
            )
        skip = dest.num_cached_blocks
        if isinstance(skip, bool) or not isinstance(skip, int):
            raise ValueError(f"num_cached_blocks must be an int, got {skip!r}")
        max_skip = (request.num_prompt_tokens - 1) // bs
        if not 0 <= skip <= max_skip:
            raise ValueError(
                f"num_cached_blocks {skip} outside 0..{max_skip} for a prompt of "
                f"{request.num_prompt_tokens} tokens (the block with the last token is sent)"
            )
        self.handoffs[request.request_id] = _Handoff(request, dest, skip)
        request.num_keep_blocks = dest.drop.num_keep_blocks if dest.drop else None  # scores it

    def plan(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """The blocks each scheduled prefill chunk completes, from the first not yet sent
        (so this worker's own prefix-cache hit goes too, unless the decode worker holds it).

        A middle chunk sends only full blocks: the next chunk writes into a partial one,
        and a send still reading it would see it change (tcp's checksum fails the request,
        a shm copy tears). The last chunk sends its partial block. A middle chunk inside
        the decode worker's cached prefix sends nothing. A dropped prompt sends nothing
        until its last chunk, then everything it keeps (`after_step`).

        Layer-wise mode returns a hook that sends layer i's blocks while layer i+1 runs."""
        bs, self._sends = self.kv.block_size, []
        for request, num_new in out.scheduled:
            handoff = self.handoffs.get(request.request_id)
            if handoff is None:
                continue
            end = request.num_computed_tokens + num_new
            last = end >= request.num_prompt_tokens
            if handoff.dest.drop is not None:
                if last:
                    self._sends.append(_Send(handoff, [], [], True))
                continue
            first = handoff.num_sent_full_blocks
            stop = cdiv(end, bs) if last else end // bs
            handoff.num_sent_full_blocks = max(first, end // bs)
            if first >= stop and not last:
                continue
            src, dst = request.block_ids[first:stop], handoff.dest.block_ids[first:stop]
            self._sends.append(_Send(handoff, src, dst, last))
        return self._layer_hook([s for s in self._sends if s.handoff.dest.drop is None])

    def _layer_hook(self, sends: list[_Send]) -> Callable[[int], None] | None:
        if self.mode != "layerwise" or not sends:
            return None
        final = self.num_layers - 1

        def on_layer_done(layer: int) -> None:
            for s in sends:
                self._send(s, [layer], s.last and layer == final)

        return on_layer_done

    def after_step(self) -> None:
        """Full mode: one send of every layer once the whole prompt is computed (all but
        the blocks the decode worker already holds). A dropped prompt, in either mode: one
        send of the blocks it keeps, now that every layer's scores exist."""
        all_layers = list(range(self.num_layers))
        for s in self._sends:
            h = s.handoff
            if h.dest.drop is not None:
                scores = self.scores_of(h.request)
                kept = h.dest.drop.kept(scores)
                num_prompt_tokens, bs = h.request.num_prompt_tokens, self.kv.block_size
                meta = {
                    "num_dropped_tokens": h.dest.drop.num_dropped_tokens(num_prompt_tokens, bs),
                    "kept_block_scores": [float(scores[i]) for i in kept],
                }
                src = [h.request.block_ids[i] for i in kept]
                self._send(_Send(h, src, h.dest.block_ids, True), all_layers, True, meta)
            elif s.last and self.mode == "full":
                skip, num_blocks = h.dest.num_cached_blocks, len(h.dest.block_ids)
                src = h.request.block_ids[skip:num_blocks]
                self._send(_Send(h, src, h.dest.block_ids[skip:], True), all_layers, True)
        self._sends = []

    def _send(
        self, s: _Send, layers: list[int], last: bool, meta: dict[str, Any] | None = None
    ) -> None:
        request_id = s.handoff.request.request_id
        if request_id not in self.handoffs:
            return  # aborted: the sender already stopped it
        if self.convert is not None:
            self.convert(layers, s.src)
        self.sender.send(s.handoff.dest.peer, request_id, layers, s.src, s.dst, last, meta)

    def on_finished(self, request: Request) -> None:
        """A prefill-only request keeps its blocks until its KV is sent."""
        handoff = self.handoffs.get(request.request_id)
        if handoff is None:
            if request.prefill_only:  # its send already failed
                self.kv.free(request)
            return
        log.debug("prefill %s: running -> sending_kv", request.request_id)
        request.status = RequestStatus.SENDING_KV
        handoff.send_deadline = self.clock() + self.send_timeout_s

    def poll(self) -> list[tuple[str, str]]:
        """Free the blocks of finished sends, abort sends past their deadline; returns
        (request id, error) per failed send (its request ended if still running)."""
        now = self.clock()
        for h in [h for h in self.handoffs.values() if h.send_deadline and h.send_deadline <= now]:
            h.send_deadline = None
            h.error = f"KV send not acknowledged within {self.send_timeout_s} s"
            log.warning("prefill %s: %s; aborting it", h.request.request_id, h.error)
            self.abort(h.request.request_id)
        failed = []
        for request_id, status, error in self.sender.pop_finished():
            handoff = self.handoffs.pop(request_id, None)
            if handoff is not None:
                self._free_if_sending(handoff.request)
                error = handoff.error or error
            ok = status is TransferStatus.DONE
            log.debug("prefill %s: sending_kv -> %s", request_id, "done" if ok else error)
            if not ok:
                if error != "aborted":  # "aborted" alone: the router's Abort, not a failure
                    timed_out = handoff is not None and handoff.error is not None
                    reason = "send_timeout" if timed_out else "send_failed"
                    if self.sender.backend == "mooncake":  # the optional library's own count
                        reason = f"mooncake_{reason}"
                    self.transfer_failures[reason] += 1
                self.scheduler.finish_request(request_id, FinishReason.ABORT)  # if running
                failed.append((request_id, error or "KV transfer failed"))
        return failed

    def abort(self, request_id: str) -> bool:
        """Stop sending. If bytes may already be moving, the blocks are freed only when the
        sender confirms it stopped reading them (`poll`); otherwise at once."""
        handoff = self.handoffs.get(request_id)
        if handoff is None:
            return False
        try:
            self.sender.status(request_id)
        except KeyError:  # nothing was ever sent
            del self.handoffs[request_id]
            self._free_if_sending(handoff.request)
            return False
        self.sender.abort(request_id)
        return False

    def _free_if_sending(self, request: Request) -> None:
        if request.status is RequestStatus.SENDING_KV:
            request.status = RequestStatus.FINISHED
            self.kv.free(request)

    def request_ids(self) -> list[str]:
        return list(self.handoffs)

    def num_in_flight(self) -> int:
        return sum(h.request.status is RequestStatus.SENDING_KV for h in self.handoffs.values())

    def transfer_stats(self) -> dict[str, Any]:
        stats = self.sender.stats()
        num_shm_fallbacks = stats.get("shm_fallbacks", 0)  # other backends have no shm
        return {
            "kv_bytes_sent": stats["bytes_sent"],
            "kv_send_s": stats.get("send_s", 0.0),
            "kv_transfer_failures": dict(self.transfer_failures),
            "kv_transfer_fallbacks": {"shm_to_tcp": num_shm_fallbacks} if num_shm_fallbacks else {},
        }
