"""Block arithmetic of the prefill and decode roles when the decode worker already holds a
prompt's prefix: which blocks it reserves and expects, which ones the prefill worker sends,
and that every reference comes back however the request ends. Torch-free (the last test
excepted), with fake transfer ends."""

from __future__ import annotations

import re

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.decode import DecodeRole, KVReservation
from pdserve.engine.roles.prefill import KVDestination, PrefillRole
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import FinishReason, Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import TransferStatus

NUM_BLOCKS, BLOCK_SIZE = 32, 4
PREFIX = list(range(10, 26))  # 16 tokens: 4 full blocks


class FakeReceiver:
    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.finished: list[tuple[str, TransferStatus, str | None]] = []
        self.metas: dict[str, dict] = {}

    def land(self, request_id: str, num_dropped_tokens: int = 0, scores=None) -> None:
        """The transfer is DONE; its last send carried what the prefill dropped."""
        self.finished.append((request_id, TransferStatus.DONE, None))
        if num_dropped_tokens or scores is not None:
            meta = {"num_dropped_tokens": num_dropped_tokens, "kept_block_scores": scores}
            self.metas[request_id] = meta

    def meta(self, request_id: str) -> dict:
        return self.metas.get(request_id, {})

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        if request_id in self.expected:
            raise ValueError(f"request {request_id!r} already has a reservation")
        self.expected[request_id] = list(block_ids)

    def pop_finished(self) -> list[tuple[str, TransferStatus, str | None]]:
        finished, self.finished = self.finished, []
        return finished

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class FakeSender:
    def __init__(self) -> None:
        self.sends: list[tuple[list[int], list[int], list[int], bool]] = []
        self.metas: dict[str, dict] = {}

    def send(self, peer, request_id, layers, src_block_ids, dst_block_ids, last, meta=None):
        self.sends.append((list(layers), list(src_block_ids), list(dst_block_ids), last))
        if meta is not None:
            self.metas[request_id] = meta


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


# ---- decode side -------------------------------------------------------------------------


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


# ---- prefill side ------------------------------------------------------------------------


def prefill_side(mode: str, prompt_len: int, num_hit_tokens: int = 0, skip: int = 0):
    """A prefill role for a request whose blocks are 100, 101, ... (the first
    `num_hit_tokens` already computed: its own prefix hit), sending to blocks 0, 1, ..."""
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_id="m")
    tx = FakeSender()
    handoff = prefill_role(tx, kv, mode)
    r = request(list(range(prompt_len)))
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    r.block_ids = list(range(100, 100 + num_blocks))
    r.num_computed_tokens = num_hit_tokens
    handoff.add_prefill(r, KVDestination({"host": "d"}, list(range(num_blocks)), skip))
    return handoff, tx, r


def prefill_role(tx: FakeSender, kv: KVCacheManager, mode: str, scores=None) -> PrefillRole:
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    return PrefillRole(tx, scheduler, kv, 2, mode, lambda request: scores)


def run_chunks(handoff: PrefillRole, r: Request, chunk: int) -> None:
    while r.num_computed_tokens < r.num_prompt_tokens:
        num_new = min(chunk, r.num_prompt_tokens - r.num_computed_tokens)
        hook = handoff.plan(SchedulerOutput([(r, num_new)]))
        for layer in range(2):
            if hook is not None:
                hook(layer)
        handoff.after_step()
        r.num_computed_tokens += num_new


def sent_dst(tx: FakeSender, layer: int) -> list[list[int]]:
    return [dst for layers, _, dst, _ in tx.sends if layer in layers]


def test_layerwise_never_sends_the_skipped_blocks() -> None:
    """22 tokens (6 blocks), chunks of 6, decode holds 3 blocks::

    chunk    0..6   6..12   12..18   18..22
    blocks   0 1    1 2     3 4      4 5      (0..2 held by decode: not sent)
    sent     -      -       3        4 5      (4 is partial until the last chunk)
    """
    handoff, tx, r = prefill_side("layerwise", 22, skip=3)
    run_chunks(handoff, r, 6)
    assert sent_dst(tx, 0) == [[3], [4, 5]] and sent_dst(tx, 1) == [[3], [4, 5]]
    assert [src for _, src, _, _ in tx.sends][:2] == [[103], [103]]
    assert [last for *_, last in tx.sends] == [False, False, False, True]


def test_layerwise_sends_its_own_prefix_hit_beyond_the_skip() -> None:
    """The prefill worker holds more of the prefix (3 blocks) than the decode one (1)."""
    handoff, tx, r = prefill_side("layerwise", 22, num_hit_tokens=12, skip=1)
    run_chunks(handoff, r, 6)
    assert sent_dst(tx, 0) == [[1, 2, 3], [4, 5]]


def test_layerwise_without_a_skip_sends_the_prefill_hit_too() -> None:
    handoff, tx, r = prefill_side("layerwise", 10, num_hit_tokens=8)
    run_chunks(handoff, r, 6)
    assert sent_dst(tx, 0) == [[0, 1, 2]]


@pytest.mark.parametrize("skip", [0, 2, 5])
def test_full_mode_sends_the_rest_once(skip: int) -> None:
    handoff, tx, r = prefill_side("full", 22, skip=skip)
    run_chunks(handoff, r, 6)
    [(layers, src, dst, last)] = tx.sends
    assert layers == [0, 1] and last
    assert dst == list(range(skip, 6)) and src == list(range(100 + skip, 106))


@pytest.mark.parametrize("skip", [-1, 6, True, "1"])
def test_a_skip_that_would_leave_nothing_to_send_is_rejected(skip) -> None:
    with pytest.raises(ValueError, match="num_cached_blocks"):
        prefill_side("full", 21, skip=skip)  # 21 tokens: blocks 0..5, at most 5 skipped


def test_layerwise_never_sends_a_block_the_next_chunk_writes() -> None:
    """No prefix anywhere: each block is sent once, after the chunk that completes it."""
    handoff, tx, r = prefill_side("layerwise", 22)
    run_chunks(handoff, r, 6)
    assert sent_dst(tx, 0) == [[0], [1, 2], [3], [4, 5]]


# ---- a prompt dropped before the transfer ------------------------------------------------

# 30 tokens (8 blocks); the decode worker keeps 5: sink 1, recent 2, the last, one more.
DROP = PromptDrop(num_keep_blocks=5, sink_blocks=1, recent_blocks=2)
SCORES = [0.0, 1.0, 7.0, 2.0, 3.0, 0.5, 0.5, 0.5]  # block 2 is the best droppable one


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
    [(0, None, "dropped 0"), (16, [1.0] * 5, "dropped 16"), (12, [1.0] * 4, "5 kept-block"),
     (12, [1.0] * 4 + [float("nan")], "finite"), (12, None, "5 kept-block")],
)  # fmt: skip
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


@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_prefill_sends_only_the_kept_blocks_once_after_the_last_chunk(mode: str) -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_id="m")
    tx = FakeSender()
    handoff = prefill_role(tx, kv, mode, SCORES)
    r = request(list(range(30)))
    r.block_ids = list(range(100, 108))
    handoff.add_prefill(r, KVDestination({"host": "d"}, [0, 1, 2, 3, 4], 0, DROP))
    assert r.num_keep_blocks == 5  # the model runner scores this prompt
    run_chunks(handoff, r, 6)
    #            sink   best   recent recent last
    assert tx.sends == [([0, 1], [100, 102, 105, 106, 107], [0, 1, 2, 3, 4], True)]
    assert tx.metas == {
        "r": {"num_dropped_tokens": 12, "kept_block_scores": [0.0, 7.0, 0.5, 0.5, 0.5]}
    }


@pytest.mark.parametrize(
    "dst, skip, match",
    [(list(range(8)), 0, "5 prompt blocks"), ([0, 1, 2, 3, 4], 1, "cached blocks to skip")],
)  # fmt: skip
def test_prefill_refuses_a_drop_that_does_not_fit(dst, skip, match) -> None:
    handoff = prefill_role(FakeSender(), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE), "full")
    with pytest.raises(ValueError, match=match):
        handoff.add_prefill(request(list(range(30))), KVDestination({}, dst, skip, DROP))
    keep_all = PromptDrop(8, 1, 2)
    with pytest.raises(ValueError, match="drops nothing"):
        handoff.add_prefill(
            request(list(range(30))), KVDestination({}, list(range(8)), 0, keep_all)
        )


# ---- roles on an engine ------------------------------------------------------------------


def test_an_engine_refuses_what_its_role_does_not_take_and_switches_only_when_idle(
    tiny_model_dir,
) -> None:
    from tests.engine.test_engine import GREEDY, make_engine

    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="collocated worker does not take Reserve"):
        engine.reserve("r", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="collocated worker does not take Prefill"):
        engine.add_prefill("p", [5, 6, 7], GREEDY, KVDestination({}, [0]))
    with pytest.raises(KeyError, match="no reservation"):
        engine.start_decode("r", 5)
    assert not engine.has_unfinished_requests()
    engine.add_request("a", [5, 6, 7], GREEDY)
    role = prefill_role(FakeSender(), engine.kv, "full")
    with pytest.raises(RuntimeError, match="cannot switch from collocated to prefill: busy"):
        engine.switch_role(role)
    while engine.has_unfinished_requests():
        engine.step()
    engine.switch_role(role)
    assert engine.role is role and engine.scheduler.preallocate_prompt
