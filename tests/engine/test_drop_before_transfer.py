"""Token dropping before the KV transfer, on a real P/D engine pair in one process: a prompt
over the decode worker's budget crosses the channel as only the blocks the decode worker
keeps, which are its sink, recent and highest-scored blocks.

Equality with a collocated engine holds where both drop at the same point: with unchunked
prefill the collocated engine drops right after the prompt, ranking by the same window
scores, so it keeps the same blocks. A chunked collocated prefill drops *during* the
prompt (after each chunk, before any score exists) and ranks by a window no longer than
the last chunk, so the chunked pair is checked for its own invariants instead."""

import time

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.roles.base import KVDestination
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregation import BLOCK_SIZE, Pair, config
from tests.engine.test_engine import GREEDY, prompts, run

# Budget 32 tokens = 8 blocks of 4; sink 1 block, recent 2 blocks.
BUDGET = {"kv_budget_tokens": 32, "kv_sink_tokens": 4, "kv_recent_tokens": 8}
BUDGET_BLOCKS = 8
CHUNK = {"long_prefill_token_threshold": 6}
GREEDY_LONG = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def budget_prompts() -> list[list[int]]:
    """Three prompts well over budget (one a whole number of blocks: its first token opens
    a new block, so one block fewer is kept), one just over, one under (sent whole)."""
    long = prompts(3, seed=7, lo=41, hi=60)
    return [
        *long,
        prompts(1, seed=8, lo=44, hi=45)[0],
        prompts(1, seed=9, lo=31, hi=32)[0],
        prompts(1, seed=10, lo=10, hi=11)[0],
    ]


def num_kept(prompt: list[int]) -> int:
    """The blocks a prompt keeps at decode start (DropPolicy arithmetic, spelled out)."""
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    return min(num_blocks, BUDGET_BLOCKS - (len(prompt) % BLOCK_SIZE == 0))


@pytest.fixture(scope="module")
def budget_reference(tiny_model_dir):
    engine = Engine(config(cache=BUDGET), tiny_model_dir)
    return [run(engine, [p], GREEDY_LONG)[0] for p in budget_prompts()]


class WatchedPair(Pair):
    """Records, before each decode step, the most blocks any running request holds."""

    max_blocks_held = 0

    def on_decode_step(self) -> None:
        for r in self.d.scheduler.running:
            self.max_blocks_held = max(self.max_blocks_held, len(r.block_ids))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_only_kept_blocks_cross_and_output_equals_collocated(
    tiny_model_dir, budget_reference, backend, mode
):
    pair = WatchedPair(tiny_model_dir, backend, mode, d_cache=BUDGET)
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        assert pair.generate(budget_prompts(), GREEDY_LONG) == budget_reference
        layout = pair.rx.layout
        per_request = pair.tx.stats()["requests"]
        for rid, prompt in zip(pair.last_ids, budget_prompts()):
            r = pair.reservations[rid]
            keep = num_kept(prompt)
            assert len(r.block_ids) == keep
            assert (r.drop is not None) == (keep < -(-len(prompt) // BLOCK_SIZE))
            assert pair.sent_dst[rid] == set(r.block_ids)
            if r.drop is not None:  # one send of the kept blocks, every layer once
                assert per_request[rid]["bytes_sent"] == keep * layout.num_layers * (
                    layout.block_bytes
                )
        assert pair.max_blocks_held <= BUDGET_BLOCKS
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
        assert pair.d.runner.block_scores == {}
        # A dropped prompt's blocks are never indexed under the original prompt's hashes.
        assert not set(pair.d.kv.pool.cached_blocks) & set(_hashes(pair, budget_prompts()[0]))
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_chunked_prefill_sends_sink_recent_and_best_blocks_in_order(tiny_model_dir, backend):
    pair = WatchedPair(tiny_model_dir, backend, "layerwise", d_cache=BUDGET, **CHUNK)
    ranked: dict[str, tuple[list[int], list[float]]] = {}  # request id -> (blocks, scores)
    sent_src: dict[str, list[int]] = {}
    scores_of, send = pair.p.role.scores_of, pair.tx.send

    def record_scores(request):
        scores = scores_of(request)
        ranked[request.request_id] = (list(request.block_ids), scores)
        return scores

    def record_src(peer, request_id, layers, src, dst, last, meta=None):
        sent_src.setdefault(request_id, []).extend(src)
        send(peer, request_id, layers, src, dst, last, meta)

    pair.p.role.scores_of, pair.tx.send = record_scores, record_src
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        outs = pair.generate(budget_prompts()[:4], GREEDY_LONG)
        assert all(len(o) == GREEDY_LONG.max_tokens for o in outs)
        for rid, prompt in zip(pair.last_ids, budget_prompts()):
            blocks, scores = ranked[rid]
            keep = num_kept(prompt)
            assert len(sent_src[rid]) == keep  # one send, every layer at once
            kept = [blocks.index(b) for b in sent_src[rid]]
            assert kept == sorted(kept)  # in order: slot arithmetic needs it
            n = len(blocks)
            assert kept[:1] == [0] and kept[-3:] == [n - 3, n - 2, n - 1]  # sink, recent, last
            middle, dropped = kept[1:-3], set(range(1, n - 3)) - set(kept)
            assert min(scores[i] for i in middle) >= max(scores[i] for i in dropped)
        assert pair.max_blocks_held <= BUDGET_BLOCKS
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


def _hashes(pair: Pair, prompt: list[int]) -> list[int]:
    from pdserve.kvcache.hashing import hash_blocks

    return hash_blocks(prompt, BLOCK_SIZE, pair.d.kv.root_hash)


def test_fewer_bytes_than_without_a_budget(tiny_model_dir):
    prompt = budget_prompts()[:1]
    with_budget = Pair(tiny_model_dir, "tcp", "full", d_cache=BUDGET)
    without = Pair(tiny_model_dir, "tcp", "full")
    try:
        with_budget.generate(prompt)
        without.generate(prompt)
        ratio = with_budget.tx.stats()["bytes_sent"] / without.tx.stats()["bytes_sent"]
        assert ratio == pytest.approx(num_kept(prompt[0]) / -(-len(prompt[0]) // BLOCK_SIZE))
    finally:
        with_budget.close()
        without.close()


def test_request_budget_drops_with_no_deployment_budget(tiny_model_dir):
    """A per-request budget is enough: neither engine has one configured, and the prefill
    engine's own (default, larger) sink and recent sizes play no part."""
    prompt = budget_prompts()[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, kv_budget_tokens=32)
    reference = Engine(config(cache={"kv_sink_tokens": 4, "kv_recent_tokens": 8}), tiny_model_dir)
    expected = run(reference, [prompt], params)
    pair = Pair(
        tiny_model_dir, "tcp", "layerwise", d_cache={"kv_sink_tokens": 4, "kv_recent_tokens": 8}
    )
    try:
        assert pair.generate([prompt], params) == expected
        assert pair.reservations[pair.last_ids[0]].drop is not None
    finally:
        pair.close()


def wait_for(pair: Pair, free_p: int) -> None:
    deadline = time.monotonic() + 10
    while pair.p.kv.num_free_blocks != free_p and time.monotonic() < deadline:
        pair.p.role.poll()
        time.sleep(0.005)
    assert pair.p.kv.num_free_blocks == free_p


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("stage", ["reserved", "mid_prefill", "sent", "first_token"])
def test_abort_at_any_stage_frees_both_sides(tiny_model_dir, backend, stage):
    pair = Pair(tiny_model_dir, backend, "layerwise", d_cache=BUDGET, **CHUNK)
    prompt = budget_prompts()[0]
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        r = pair.d.reserve("a", prompt, GREEDY)
        assert r.drop is not None and pair.d.kv.num_free_blocks == free_d - num_kept(prompt)
        if stage != "reserved":
            dest = KVDestination(pair.rx.address(), r.block_ids, 0, r.drop)
            pair.p.add_prefill("a", prompt, GREEDY, dest)
            pair.p.step()
            assert "a" not in pair.sent_dst  # nothing crosses before the last chunk
        if stage in ("sent", "first_token"):
            outs = []
            while pair.p.has_unfinished_requests():
                outs += pair.p.step()
            assert pair.sent_dst["a"] == set(r.block_ids)
            if stage == "first_token":
                pair.d.role.start("a", outs[-1].new_token_ids[0])
        pair.p.abort_request("a")
        pair.d.abort_request("a")
        assert pair.d.kv.num_free_blocks == free_d
        assert pair.rx.stats()["num_reservations"] == 0
        assert pair.d.role.awaiting == {}
        wait_for(pair, free_p)
        assert not pair.p.has_unfinished_requests() and not pair.d.has_unfinished_requests()
    finally:
        pair.close()


def test_a_transfer_that_does_not_match_the_reservation_fails_it(tiny_model_dir):
    """The drop arrives with the KV (the last send's meta); one the reservation did not
    make fails the request and frees its blocks."""
    pair = Pair(tiny_model_dir, "tcp", "full", d_cache=BUDGET)
    prompt = budget_prompts()[0]

    def land(request_id: str, meta: dict | None) -> list[tuple[str, str]]:
        r = pair.reservations[request_id] = pair.d.reserve(request_id, prompt, GREEDY)
        src = list(range(len(r.block_ids)))
        pair.tx.send(pair.rx.address(), request_id, [0, 1], src, r.block_ids, True, meta)
        deadline = time.monotonic() + 10
        while not (failed := pair.d.role.poll()) and time.monotonic() < deadline:
            time.sleep(0.005)
        return failed

    try:
        free_d = pair.d.kv.num_free_blocks
        [(_, error)] = land("a", None)  # a prefill that sent the whole prompt
        assert "dropped 0 prompt tokens" in error
        assert pair.d.kv.num_free_blocks == free_d
        dropped = pair.reservations["a"].drop.num_dropped_tokens(len(prompt), BLOCK_SIZE)
        [(_, error)] = land("b", {"num_dropped_tokens": dropped, "kept_block_scores": [1.0]})
        assert "kept-block scores" in error
        assert pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


def test_fp32_prefill_into_a_budgeted_fp8_decode(tiny_model_dir):
    """Only the kept blocks are re-encoded to FP8 and sent; the output is a collocated FP8
    engine's with the same budget."""
    fp8 = Engine(config("fp8", cache=BUDGET), tiny_model_dir)
    reference = [run(fp8, [p], GREEDY_LONG)[0] for p in budget_prompts()[:3]]
    pair = Pair(tiny_model_dir, "tcp", "full", "auto", "fp8", d_cache=BUDGET)
    try:
        assert pair.generate(budget_prompts()[:3], GREEDY_LONG) == reference
        kept = sum(num_kept(p) for p in budget_prompts()[:3])
        assert pair.tx.stats()["bytes_sent"] == kept * 2 * 2 * 2 * BLOCK_SIZE * 20  # FP8 rows
    finally:
        pair.close()
