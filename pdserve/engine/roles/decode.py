"""The decode role: reserve blocks for a prompt's KV, wait for it and the first token, then
hand the request to the scheduler as RUNNING.

One request::

    WAITING_FOR_KV (blocks reserved: the prompt's prefix this worker already caches is
                    shared, the rest is new and only the new blocks are expected)
      -> RUNNING once both the KV has landed and the first token is known; the reservation
         is released first, so no late write lands.
      -> FINISHED (blocks freed) when the transfer fails, the request is aborted, or a
         deadline passes: `reserve_timeout_s` after Reserve (no prefill ever came: the
         router or the prefill worker is gone), `land_timeout_s` after the first token (only
         bytes in flight remain). Blocks a shm writer may still write into are freed only
         once the receiver lists them in `pop_unfenced` (docs/transfer.md, "Fencing").

A prompt over the request's KV budget is dropped before the transfer (PromptDrop): only the
blocks it keeps are reserved, without the prefix cache, and the transfer's completion
brings the kept blocks' scores, from which this worker's own dropping continues.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.roles.base import KVReservation, Role
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request, RequestStatus
from pdserve.transfer import KVTransferConfig
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.receiver import SocketKVReceiver

log = logging.getLogger(__name__)

# The transfer's knobs (KVTransferConfig, `--transfer-reserve-timeout-s`), when not given.
RESERVE_TIMEOUT_S = KVTransferConfig().reserve_timeout_s
LAND_TIMEOUT_S = KVTransferConfig().land_timeout_s


@dataclass
class _Awaiting:
    """One reserved request, until it runs or is dropped."""

    request: Request
    deadline: float
    deadline_error: str
    num_dropped_tokens: int = 0  # before the transfer, as reserved
    landed: bool = False
    first_token_id: int | None = None
    kept_block_scores: list[float] | None = None  # a dropped prompt's, with the KV


class DecodeRole(Role):
    name = "decode"
    takes_pins = False

    def __init__(
        self,
        receiver: SocketKVReceiver,
        scheduler: Scheduler,
        kv: KVCacheManager,
        install_scores: Callable[[Request, list[float]], None],
        reserve_timeout_s: float = RESERVE_TIMEOUT_S,
        land_timeout_s: float = LAND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`install_scores` hands a dropped prompt's kept-block scores to the model runner."""
        self.receiver, self.scheduler, self.kv = receiver, scheduler, kv
        self.install_scores = install_scores
        self.reserve_timeout_s, self.land_timeout_s = reserve_timeout_s, land_timeout_s
        self.clock = clock
        self.awaiting: dict[str, _Awaiting] = {}
        self.fenced: dict[str, Request] = {}  # released while a KV write may still land
        self.kv_blocks_skipped = 0  # prompt blocks reserved from the own prefix cache, never sent
        # Failed transfers by reason (reserve_timeout, land_timeout, bad_meta, receive_failed):
        # each one's request is re-driven by the router, so its answer came by a fallback.
        self.transfer_failures = collections.Counter[str]()

    def reserve(self, request: Request, drop: PromptDrop | None = None) -> KVReservation | None:
        """Blocks for the prompt's KV, or None when they do not fit right now.

        The prompt's longest prefix this worker already caches is taken by reference (its
        blocks are shared and only read); the receiver expects just the new blocks, so a
        write into a shared cached block is rejected by the transfer layer. A prompt over
        budget (`drop`) gets only the blocks it keeps, and no prefix-cache hit (the kept
        blocks are scattered through the prompt; a hit would rarely line up with them)."""
        request_id, bs = request.request_id, self.kv.block_size
        if request_id in self.awaiting or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        hits = [] if drop else self.kv.find_cached_prefix(request)
        num_dropped = drop.num_dropped_tokens(request.num_prompt_tokens, bs) if drop else 0
        num_new_tokens = request.num_prompt_tokens - len(hits) * bs - num_dropped
        if not self.kv.allocate(request, num_new_tokens, hits):
            return None
        try:
            self.receiver.expect(request_id, request.block_ids[len(hits) :])
        except ValueError:
            self.kv.free(request)  # the hit's references too
            raise
        request.status = RequestStatus.WAITING_FOR_KV
        self.awaiting[request_id] = _Awaiting(
            request,
            self.clock() + self.reserve_timeout_s,
            f"no KV within {self.reserve_timeout_s} s",
            num_dropped,
        )
        self.kv_blocks_skipped += len(hits)
        log.debug("decode %s: -> waiting_for_kv (%d cached blocks)", request_id, len(hits))
        return KVReservation(list(request.block_ids), len(hits), drop)

    def start(self, request_id: str, first_token_id: int) -> None:
        """The first token is known: run once the KV has landed too."""
        waiting = self.awaiting.get(request_id)
        if waiting is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        waiting.first_token_id = first_token_id
        waiting.deadline = self.clock() + self.land_timeout_s
        waiting.deadline_error = (
            f"KV did not land within {self.land_timeout_s} s of the first token"
        )
        self._activate_if_ready(waiting)

    def poll(self) -> list[tuple[str, str]]:
        """Activate requests whose KV landed; returns (request id, error) of failed ones
        (transfer errors, reservations past their deadline, and a prompt dropped before the
        transfer otherwise than reserved: the transfer's `meta` says what the prefill
        dropped and the kept blocks' scores)."""
        for request_id in self.receiver.pop_unfenced():
            self.kv.free(self.fenced.pop(request_id))
        failed = []
        now = self.clock()
        for request_id, waiting in list(self.awaiting.items()):
            if waiting.deadline <= now:
                error = waiting.deadline_error
                log.warning("decode %s: %s; releasing its blocks", request_id, error)
                landing = waiting.first_token_id is not None
                self.transfer_failures["land_timeout" if landing else "reserve_timeout"] += 1
                self._drop(request_id)
                failed.append((request_id, waiting.deadline_error))
        for request_id, status, error in self.receiver.pop_finished():
            waiting = self.awaiting.get(request_id)
            if waiting is None:
                continue
            if status is TransferStatus.DONE:
                try:
                    waiting.kept_block_scores = _kept_block_scores(
                        waiting, self.receiver.meta(request_id)
                    )
                except ValueError as exc:
                    self.transfer_failures["bad_meta"] += 1
                    self._drop(request_id)
                    failed.append((request_id, str(exc)))
                    continue
                waiting.landed = True
                waiting.request.stamps["kv_landed"] = time.time()
                self._activate_if_ready(waiting)
            else:
                reason = "receive_failed"
                if "mooncake" in self.receiver.backends:  # the optional library's own count
                    reason = f"mooncake_{reason}"
                self.transfer_failures[reason] += 1
                self._drop(request_id)
                failed.append((request_id, error or "KV transfer failed"))
        return failed

    def abort(self, request_id: str) -> bool:
        if request_id not in self.awaiting:
            return False
        self._drop(request_id)
        return True

    def request_ids(self) -> list[str]:
        return list(self.awaiting)

    def num_in_flight(self) -> int:
        return len(self.awaiting)

    def transfer_stats(self) -> dict[str, Any]:
        return {
            "kv_bytes_received": self.receiver.stats().get("bytes_received", 0),
            "kv_blocks_skipped": self.kv_blocks_skipped,
            "kv_transfer_failures": dict(self.transfer_failures),
        }

    def _activate_if_ready(self, waiting: _Awaiting) -> None:
        if not waiting.landed or waiting.first_token_id is None:
            return
        request = waiting.request
        del self.awaiting[request.request_id]
        log.debug("decode %s: waiting_for_kv -> running", request.request_id)
        request.output_token_ids.append(waiting.first_token_id)
        request.num_computed_tokens = request.num_prompt_tokens
        # Positions stay original (RoPE), KV slots shift: the first token's KV goes to slot
        # num_prompt_tokens - num_dropped_tokens, right after the last kept block's tokens.
        request.num_dropped_tokens = waiting.num_dropped_tokens
        if waiting.kept_block_scores is not None:
            self.install_scores(request, waiting.kept_block_scores)
        self.receiver.release(request.request_id)
        # A no-op after a drop (block i no longer holds hash i), as in the collocated path.
        self.kv.cache_computed_blocks(request)
        self.scheduler.add_running(request)

    def _drop(self, request_id: str) -> None:
        request = self.awaiting.pop(request_id).request
        log.debug("decode %s: waiting_for_kv -> finished (blocks freed)", request_id)
        safe = self.receiver.release(request_id)  # False: a write may still land (fenced)
        request.status = RequestStatus.FINISHED
        if safe:
            self.kv.free(request)
        else:
            self.fenced[request_id] = request  # its blocks are freed once pop_unfenced says


def _kept_block_scores(waiting: _Awaiting, meta: dict) -> list[float] | None:
    """A dropped prompt's kept blocks' scores from the transfer's `meta`, checked against
    the reservation (ValueError when it does not match)."""
    request, expected = waiting.request, waiting.num_dropped_tokens
    num_dropped, scores = meta.get("num_dropped_tokens", 0), meta.get("kept_block_scores")
    if num_dropped != expected:
        raise ValueError(
            f"request {request.request_id!r}: the prefill dropped {num_dropped!r} "
            f"prompt tokens, the reservation expects {expected}"
        )
    if not expected:
        if scores is not None:
            raise ValueError(
                f"request {request.request_id!r}: kept-block scores for a prompt sent whole"
            )
        return None
    if not isinstance(scores, list) or len(scores) != len(request.block_ids):
        raise ValueError(
            f"request {request.request_id!r}: expected {len(request.block_ids)} kept-block "
            f"scores, got {scores!r:.80}"
        )
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in scores):
        raise ValueError(f"request {request.request_id!r}: kept-block scores must be finite")
    return [float(x) for x in scores]
