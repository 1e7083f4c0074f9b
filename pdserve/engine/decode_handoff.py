"""The decode half of disaggregation (the module docstring of engine/kv_handoff.py tells
the whole handoff): reserve blocks for a prompt's KV, wait for it and the first token, then
hand the request to the scheduler as RUNNING."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request, RequestStatus
from pdserve.transfer.base import KVReceiver, TransferStatus

log = logging.getLogger(__name__)

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
    already holding this prefix's KV, so they are never written and never sent. With `drop`
    (a prompt over budget) there are only `drop.num_keep_blocks` blocks and no cached ones."""

    block_ids: list[int]
    num_cached_blocks: int = 0
    drop: PromptDrop | None = None


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
        self.drops: dict[str, int] = {}  # request id -> prompt tokens dropped before transfer
        self.kept_scores: dict[str, list[float]] = {}  # from StartDecode, until activation
        # Hands a dropped prompt's kept-block scores to the model runner at activation.
        self.install_scores: Callable[[Request, list[float]], None] | None = None

    def reserve(self, request: Request, drop: PromptDrop | None = None) -> KVReservation | None:
        """Blocks for the prompt's KV, or None when they do not fit right now.

        The prompt's longest prefix this worker already caches is taken by reference (its
        blocks are shared and only read); the receiver expects just the new blocks, so a
        write into a shared cached block is rejected by the transfer layer. A prompt over
        budget (`drop`) gets only the blocks it keeps, and no prefix-cache hit (the kept
        blocks are scattered through the prompt; a hit would rarely line up with them)."""
        bs = self.kv.block_size
        hits = [] if drop else self.kv.find_cached_prefix(request)
        num_new_tokens = request.num_prompt_tokens - len(hits) * bs
        if drop is not None:
            num_new_tokens -= drop.num_dropped_tokens(request.num_prompt_tokens, bs)
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
        if drop is not None:
            self.drops[request.request_id] = drop.num_dropped_tokens(request.num_prompt_tokens, bs)
        log.debug("decode %s: -> waiting_for_kv (%d cached blocks)", request.request_id, len(hits))
        return KVReservation(list(request.block_ids), len(hits), drop)

    def start(
        self,
        request_id: str,
        first_token_id: int,
        num_dropped_tokens: int = 0,
        block_scores: list[float] | None = None,
    ) -> None:
        """The first token is known (and, for a prompt dropped before the transfer, how
        many tokens went and the kept blocks' scores). A reply that does not match the
        reservation fails the request (ValueError) and frees its blocks."""
        if request_id not in self.awaiting:
            raise KeyError(f"no reservation for request {request_id!r}")
        try:
            self._check_drop(self.awaiting[request_id], num_dropped_tokens, block_scores)
        except ValueError:
            self._drop(request_id)
            raise
        if block_scores is not None:
            self.kept_scores[request_id] = [float(x) for x in block_scores]
        self.first_tokens[request_id] = first_token_id
        what = f"KV did not land within {self.land_timeout_s} s of the first token"
        self._deadlines[request_id] = (self.clock() + self.land_timeout_s, what)
        self._activate_if_ready(request_id)

    def _check_drop(
        self, request: Request, num_dropped_tokens: int, block_scores: list[float] | None
    ) -> None:
        expected = self.drops.get(request.request_id, 0)
        if num_dropped_tokens != expected:
            raise ValueError(
                f"request {request.request_id!r}: the prefill dropped {num_dropped_tokens!r} "
                f"prompt tokens, the reservation expects {expected}"
            )
        if not expected:
            if block_scores is not None:
                raise ValueError(
                    f"request {request.request_id!r}: kept-block scores for a prompt sent whole"
                )
            return
        if not isinstance(block_scores, list) or len(block_scores) != len(request.block_ids):
            raise ValueError(
                f"request {request.request_id!r}: expected {len(request.block_ids)} kept-block "
                f"scores, got {block_scores!r:.80}"
            )
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in block_scores):
            raise ValueError(f"request {request.request_id!r}: kept-block scores must be finite")

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
        # Positions stay original (RoPE), KV slots shift: the first token's KV goes to slot
        # num_prompt_tokens - num_dropped_tokens, right after the last kept block's tokens.
        request.num_dropped_tokens = self.drops.pop(request_id, 0)
        scores = self.kept_scores.pop(request_id, None)
        if scores is not None and self.install_scores is not None:
            self.install_scores(request, scores)
        self.receiver.release(request_id)
        # A no-op after a drop (block i no longer holds hash i), as in the collocated path.
        self.kv.cache_computed_blocks(request)
        self.scheduler.add_running(request)

    def _drop(self, request_id: str) -> None:
        request = self.awaiting.pop(request_id)
        self._deadlines.pop(request_id, None)
        log.debug("decode %s: waiting_for_kv -> finished (blocks freed)", request_id)
        self.receiver.release(request_id)  # returns only once no write can land any more
        self.landed.discard(request_id)
        self.first_tokens.pop(request_id, None)
        self.drops.pop(request_id, None)
        self.kept_scores.pop(request_id, None)
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
