"""The decode role's block arithmetic when it already holds a prompt's prefix: which blocks
it reserves and expects, and that every reference comes back however the request ends;
a prompt dropped before the transfer. Torch-free, with a fake receiver."""

from __future__ import annotations

import re

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.base import KVReservation
from pdserve.engine.roles.decode import DecodeRole
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import FinishReason, Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import TransferStatus
from tests.engine.roles.fakes import FakeReceiver

NUM_BLOCKS, BLOCK_SIZE = 32, 4
PREFIX = list(range(10, 26))  # 16 tokens: 4 full blocks
# 30 tokens (8 blocks); the decode worker keeps 5: sink 1, recent 2, the last, one more.
DROP = PromptDrop(num_keep_blocks=5, sink_blocks=1, recent_blocks=2)


def request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=4))


def decode_side(now: list[float] | None = None, install=lambda request, scores: None):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_id="m")
    rx = FakeReceiver()
    clock = (lambda: now[0]) if now is not None else (lambda: 0.0)
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    handoff = DecodeRole(rx, scheduler, kv, install, 30.0, 5.0, clock)
    return handoff, rx, kv


def cache_prefix(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    """Leave `tokens`' full blocks cached and free, as a finished earlier request does."""
    earlier = request(tokens, "earlier")
    assert kv.allocate(earlier, len(tokens))
    earlier.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(earlier)
    blocks = list(earlier.block_ids)
    kv.free(earlier)
    return blocks[: len(tokens) // BLOCK_SIZE]


def test_reserve_takes_the_cached_prefix_and_expects_only_new_blocks() -> None:
    handoff, rx, kv = decode_side()
    cached = cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    r = handoff.reserve(request(PREFIX + [7, 8, 9, 1, 2, 3]))  # 22 tokens: 6 blocks
    assert isinstance(r, KVReservation) and r.num_cached_blocks == 4
    assert r.block_ids[:4] == cached and len(r.block_ids) == 6
    assert rx.expected["r"] == r.block_ids[4:]
    assert [kv.pool.ref_cnt[b] for b in r.block_ids] == [1] * 6
    assert handoff.kv_blocks_skipped == 4
    assert handoff.abort("r")
    assert kv.num_free_blocks == free and all(kv.pool.ref_cnt[b] == 0 for b in r.block_ids)
    again = handoff.reserve(request(PREFIX + [7], "again"))  # the prefix is still cached
    assert again.block_ids[:4] == cached


def test_a_whole_cached_prompt_still_expects_its_last_block() -> None:
    handoff, rx, kv = decode_side()
    cached = cache_prefix(kv, PREFIX)
    r = handoff.reserve(request(PREFIX))  # every block cached; the last token is computed
    assert r.num_cached_blocks == 3 and r.block_ids[:3] == cached[:3]
    assert rx.expected["r"] == r.block_ids[3:] and cached[3] not in rx.expected["r"]


def test_shared_prefix_references_are_dropped_not_freed() -> None:
    """Two reservations share the cached prefix; ending one leaves the other's intact."""
    handoff, rx, kv = decode_side()
    cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    a = handoff.reserve(request(PREFIX + [1], "a"))
    b = handoff.reserve(request(PREFIX + [2, 3], "b"))
    assert a.block_ids[:4] == b.block_ids[:4]
    assert [kv.pool.ref_cnt[x] for x in a.block_ids[:4]] == [2] * 4
    handoff.abort("a")
    assert [kv.pool.ref_cnt[x] for x in b.block_ids] == [1] * 5
    handoff.abort("b")
    assert kv.num_free_blocks == free


def test_landed_kv_runs_on_the_shared_prefix_and_caches_the_new_blocks() -> None:
    handoff, rx, kv = decode_side()
    cached = cache_prefix(kv, PREFIX)
    prompt = PREFIX + [7, 8, 9, 1, 2, 3]
    r = handoff.reserve(request(prompt))
    rx.finished.append(("r", TransferStatus.DONE, None))
    handoff.start("r", 5)
    assert handoff.poll() == []
    running = handoff.scheduler.requests["r"]
    assert running.block_ids == r.block_ids and running.block_ids[:4] == cached
    assert running.num_computed_tokens == len(prompt) and running.output_token_ids == [5]
    hashes = running.block_hashes
    assert kv.pool.lookup(hashes[4]) == r.block_ids[4]  # the received full block is indexed
    free = kv.num_free_blocks
    handoff.scheduler.finish_request("r", FinishReason.STOP)
    assert kv.num_free_blocks == free + 6


@pytest.mark.parametrize("stage", ["before_prefill", "after_first_token"])
def test_deadline_expiry_releases_new_blocks_and_prefix_references(stage: str) -> None:
    now = [0.0]
    handoff, rx, kv = decode_side(now)
    cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    handoff.reserve(request(PREFIX + [1, 2]))
    if stage == "after_first_token":
        handoff.start("r", 5)
    now[0] = 31.0
    [(request_id, _)] = handoff.poll()
    assert request_id == "r" and rx.released == ["r"]
    assert kv.num_free_blocks == free and not any(kv.pool.ref_cnt)


def test_failed_transfer_releases_prefix_references() -> None:
    handoff, rx, kv = decode_side()
    cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    handoff.reserve(request(PREFIX + [1, 2]))
    rx.finished.append(("r", TransferStatus.FAILED, "write outside the reservation"))
    assert handoff.poll() == [("r", "write outside the reservation")]
    assert kv.num_free_blocks == free and not any(kv.pool.ref_cnt)


def test_no_room_changes_nothing() -> None:
    handoff, rx, kv = decode_side()
    cache_prefix(kv, PREFIX)
    filler = request(list(range(100, 100 + 4 * (NUM_BLOCKS - 5))), "filler")
    assert kv.allocate(filler, filler.num_prompt_tokens)  # leaves the 4 cached + 1 free
    assert handoff.reserve(request(PREFIX + list(range(9)))) is None  # needs 3 new blocks
    assert not rx.expected and kv.num_free_blocks == 5 and sum(kv.pool.ref_cnt) == 27


def test_a_refused_expectation_returns_every_block() -> None:
    handoff, rx, kv = decode_side()
    cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    rx.expected["r"] = []  # the receiver already knows this id
    with pytest.raises(ValueError, match="already has a reservation"):
        handoff.reserve(request(PREFIX + [1]))
    assert kv.num_free_blocks == free and "r" not in handoff.awaiting


def test_decode_reserves_only_the_kept_blocks_and_skips_its_prefix_cache() -> None:
    handoff, rx, kv = decode_side()
    cache_prefix(kv, PREFIX)
    free = kv.num_free_blocks
    r = handoff.reserve(request(PREFIX + list(range(14))), DROP)  # 30 tokens, 8 blocks
    assert r.num_cached_blocks == 0 and r.drop == DROP and len(r.block_ids) == 5
    assert rx.expected["r"] == r.block_ids and kv.num_free_blocks == free - 5
    assert handoff.awaiting["r"].num_dropped_tokens == 12  # 3 full blocks


def test_landed_dropped_prompt_starts_after_its_kept_tokens_and_indexes_nothing() -> None:
    installed = {}
    handoff, rx, kv = decode_side(
        install=lambda req, scores: installed.update({req.request_id: scores})
    )
    r = handoff.reserve(request(list(range(30))), DROP)
    rx.land("r", 12, [1.0, 7.0, 0.5, 0.5, 0.5])
    handoff.start("r", 5)
    assert handoff.poll() == []
    running = handoff.scheduler.requests["r"]
    assert running.block_ids == r.block_ids and running.num_computed_tokens == 30
    # The first token (position 30) gets its KV at slot 30 - 12 = 18: block 4, offset 2.
    assert running.num_dropped_tokens == 12 and running.num_kv_tokens == 18
    assert installed == {"r": [1.0, 7.0, 0.5, 0.5, 0.5]}
    assert kv.pool.cached_blocks == {}  # block i no longer holds hash i
    assert handoff.awaiting == {}  # nothing kept about it
    free = kv.num_free_blocks
    handoff.scheduler.finish_request("r", FinishReason.STOP)
    assert kv.num_free_blocks == free + 5


@pytest.mark.parametrize(
    "dropped, scores, match",
    [
        (0, None, "dropped 0"),
        (16, [1.0] * 5, "dropped 16"),
        (12, [1.0] * 4, "5 kept-block"),
        (12, [1.0] * 4 + [float("nan")], "finite"),
        (12, None, "5 kept-block"),
    ],
)
def test_a_transfer_that_does_not_match_the_drop_frees_the_reservation(dropped, scores, match):
    handoff, rx, kv = decode_side()
    free = kv.num_free_blocks
    handoff.reserve(request(list(range(30))), DROP)
    handoff.start("r", 5)
    rx.land("r", dropped, scores)
    [(request_id, error)] = handoff.poll()
    assert request_id == "r" and re.search(match, error)
    assert kv.num_free_blocks == free and rx.released == ["r"] and not handoff.awaiting


def test_a_drop_where_none_was_reserved_is_refused() -> None:
    handoff, rx, kv = decode_side()
    handoff.reserve(request(list(range(30))))
    rx.land("r", 12, [1.0] * 8)
    handoff.reserve(request(list(range(30)), "s"))
    rx.land("s", 0, [1.0] * 8)
    [(_, expects_0), (_, sent_whole)] = handoff.poll()
    assert "expects 0" in expects_0 and "prompt sent whole" in sent_whole


@pytest.mark.parametrize("stage", ["before_prefill", "after_first_token"])
def test_dropped_reservation_deadline_frees_everything(stage: str) -> None:
    now = [0.0]
    handoff, rx, kv = decode_side(now)
    free = kv.num_free_blocks
    handoff.reserve(request(list(range(30))), DROP)
    if stage == "after_first_token":
        handoff.start("r", 5)
    now[0] = 31.0
    [(request_id, _)] = handoff.poll()
    assert request_id == "r" and kv.num_free_blocks == free
    assert not handoff.awaiting
