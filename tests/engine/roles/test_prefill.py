"""The prefill role's sends: which blocks each chunk sends, never the decode worker's
cached prefix, never a block the next chunk writes; a prompt dropped before the transfer.
Torch-free, with a fake sender (the last test excepted: roles on an engine)."""

from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.base import KVDestination
from pdserve.engine.roles.prefill import PrefillRole
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.dropping import PromptDrop
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from tests.engine.roles.test_decode import BLOCK_SIZE, DROP, NUM_BLOCKS, request

SCORES = [0.0, 1.0, 7.0, 2.0, 3.0, 0.5, 0.5, 0.5]  # block 2 is the best droppable one


class FakeSender:
    backend = "tcp"

    def __init__(self) -> None:
        self.sends: list[tuple[list[int], list[int], list[int], bool]] = []
        self.metas: dict[str, dict] = {}

    def send(self, peer, request_id, layers, src_block_ids, dst_block_ids, last, meta=None):
        self.sends.append((list(layers), list(src_block_ids), list(dst_block_ids), last))
        if meta is not None:
            self.metas[request_id] = meta


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
)
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
        engine.role.start("r", 5)
    assert not engine.has_unfinished_requests()
    engine.add_request("a", [5, 6, 7], GREEDY)
    role = prefill_role(FakeSender(), engine.kv, "full")
    with pytest.raises(RuntimeError, match="cannot switch from collocated to prefill: busy"):
        engine.switch_role(role)
    while engine.has_unfinished_requests():
        engine.step()
    engine.switch_role(role)
    assert engine.role is role and engine.scheduler.preallocate_prompt


@pytest.mark.parametrize("num_fallbacks, expected", [(0, {}), (2, {"shm_to_tcp": 2})])
def test_the_senders_shm_fallbacks_reach_the_stats_by_reason(num_fallbacks, expected) -> None:
    tx = FakeSender()
    tx.stats = lambda: {"bytes_sent": 5, "shm_fallbacks": num_fallbacks, "send_s": 0.5}
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_id="m")
    stats = prefill_role(tx, kv, "layerwise").transfer_stats()
    assert stats["kv_bytes_sent"] == 5 and stats["kv_transfer_fallbacks"] == expected
    assert stats["kv_send_s"] == 0.5  # the link's rate, for the planner
