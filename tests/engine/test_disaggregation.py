"""A prefill engine and a decode engine in one process, joined by a real KV transfer,
produce exactly the collocated engine's greedy output — for every backend and mode, with
chunked prefill and prefix hits on either side — and leak no block on either side."""

import random
import time

import pytest
import torch

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.roles.base import KVDestination, KVReservation
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.layout import KVLayout
from pdserve.workers.worker import shared_kv
from tests.engine.test_engine import GREEDY, prompts, run
from tests.transfer.conftest import needs_mooncake

SECRET = b"k" * 32
BACKENDS = ["tcp", "shm", pytest.param("mooncake", marks=needs_mooncake)]
NUM_BLOCKS, BLOCK_SIZE = 128, 4


def config(kv_cache_dtype="auto", cache=None, dtype="float32", **sched) -> EngineConfig:
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        kv_cache_bytes=NUM_BLOCKS * BLOCK_SIZE * 512,
        kv_cache_dtype=kv_cache_dtype,
        **(cache or {}),
    )
    return EngineConfig(
        model="tiny",
        cache=cache,
        scheduler=SchedulerConfig(**sched),
        device=DeviceConfig(dtype=dtype),
    )


class Pair:
    def __init__(
        self,
        model_dir,
        backend,
        mode,
        p_dtype="auto",
        d_dtype="auto",
        d_cache=None,
        p_model_dtype="float32",
        **sched,
    ) -> None:
        """`d_cache`: CacheConfig fields of the decode engine only (e.g. a KV budget);
        `p_model_dtype`: the prefill engine's dtype (the decode engine's is float32)."""
        allocate = shared_kv if backend == "shm" else None
        self.d = Engine(config(d_dtype, d_cache), model_dir, "decode", allocate)
        kv = self.d.runner.kv_cache
        self.rx = make_receiver(backend, kv, KVLayout.from_tensor(kv), SECRET)
        self.d.switch_role(self.d.decode_role(self.rx))
        self.p = Engine(config(p_dtype, dtype=p_model_dtype, **sched), model_dir, "prefill")
        wire = self.p.wire_source(d_dtype, "float32")
        source = wire.kv if wire else self.p.runner.kv_cache
        self.tx = make_sender(backend, source, KVLayout.from_tensor(source), SECRET)
        self.p.switch_role(self.p.prefill_role(self.tx, mode, wire))
        self.reservations: dict[str, KVReservation] = {}
        self.sent_dst: dict[str, set[int]] = {}  # request id -> destination blocks sent
        self.sent_pairs: set[tuple[int, int]] = set()  # (source, destination) blocks sent
        send = self.tx.send

        def record(peer, request_id, layers, src_block_ids, dst_block_ids, last, meta=None):
            self.sent_dst.setdefault(request_id, set()).update(dst_block_ids)
            self.sent_pairs.update(zip(src_block_ids, dst_block_ids))
            send(peer, request_id, layers, src_block_ids, dst_block_ids, last, meta)

        self.tx.send = record

    def on_decode_step(self) -> None:
        """Called before each decode step (tests watch the decode side's blocks here)."""

    def close(self):
        self.tx.close()
        self.rx.close()

    def generate(self, prompt_sets: list[list[int]], params=GREEDY) -> list[list[int]]:
        """Plays the router: reserve on D, prefill on P, hand the first token to D."""
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompt_sets):
            rid = f"r{i}-{time.monotonic_ns()}"
            r = self.reservations[rid] = self.d.reserve(rid, prompt, params)
            assert r is not None
            dest = KVDestination(self.rx.address(), r.block_ids, r.num_cached_blocks, r.drop)
            self.p.add_prefill(rid, prompt, params, dest)
            out[rid] = []
        pending = set(out)
        deadline = time.monotonic() + 30
        while pending and time.monotonic() < deadline:
            assert self.p.role.poll() == [] and self.d.role.poll() == []
            if self.p.has_unfinished_requests():
                for o in self.p.step():
                    out[o.request_id] += o.new_token_ids
                    if o.finish_reason is FinishReason.HANDOFF:
                        self.d.role.start(o.request_id, o.new_token_ids[0])
                    else:
                        self.d.abort_request(o.request_id)
                        pending.discard(o.request_id)
            if self.d.has_unfinished_requests():
                self.on_decode_step()
                for o in self.d.step():
                    out[o.request_id] += o.new_token_ids
                    if o.finished:
                        pending.discard(o.request_id)
            else:
                time.sleep(0.001)
        # Let the prefill side see its sends confirmed and free its blocks.
        while self.p.role.num_in_flight() and time.monotonic() < deadline:
            self.p.role.poll()
            time.sleep(0.001)
        assert not pending, "requests did not finish"
        self.last_ids = list(out)
        return list(out.values())


@pytest.fixture(scope="module")
def collocated(tiny_model_dir):
    engine = Engine(config(), tiny_model_dir)
    return [run(engine, [p])[0] for p in prompts(5)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_disaggregated_equals_collocated(tiny_model_dir, collocated, backend, mode):
    pair = Pair(tiny_model_dir, backend, mode, long_prefill_token_threshold=6)  # chunked
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        assert pair.generate(prompts(5)) == collocated
        # Again: both sides now hit their prefix caches; only the last blocks are sent.
        assert pair.generate(prompts(5)) == collocated
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
        assert pair.tx.stats()["num_writes"] > 0
    finally:
        pair.close()


def shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    """A 26-token prefix (6 full blocks of 4 and a partial one) and prompts extending it."""
    rng = random.Random(11)
    prefix = [rng.randrange(2, 128) for _ in range(26)]
    return prefix, [prefix + [rng.randrange(2, 128) for _ in range(k)] for k in (1, 3, 9, 14)]


@pytest.fixture(scope="module")
def shared_reference(tiny_model_dir):
    engine = Engine(config(), tiny_model_dir)
    return [run(engine, [p])[0] for p in shared_prefix_prompts()[1]]


def assert_only_new_blocks_sent(pair: Pair, num_cached_blocks: int) -> None:
    """Each request of the last `generate` got exactly its new blocks, nothing cached."""
    layout, num_layers = pair.rx.layout, pair.rx.layout.num_layers
    per_request = pair.tx.stats()["requests"]
    for rid in pair.last_ids:
        r = pair.reservations[rid]
        assert r.num_cached_blocks == num_cached_blocks
        assert pair.sent_dst[rid] == set(r.block_ids[num_cached_blocks:])
        if pair.p.role.mode == "full":  # one send: every new block once per layer
            expected = len(r.block_ids[num_cached_blocks:]) * num_layers * layout.block_bytes
            assert per_request[rid]["bytes_sent"] == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_decode_holding_the_prefix_receives_only_the_rest(
    tiny_model_dir, shared_reference, backend, mode
):
    _, later = shared_prefix_prompts()
    pair = Pair(tiny_model_dir, backend, mode, long_prefill_token_threshold=6)  # chunked
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        assert pair.generate(later[:1]) == shared_reference[:1]
        assert pair.reservations[pair.last_ids[0]].num_cached_blocks == 0
        cold_bytes = pair.tx.stats()["bytes_sent"]
        assert pair.generate(later[1:]) == shared_reference[1:]
        assert_only_new_blocks_sent(pair, 6)
        warm_bytes = pair.tx.stats()["bytes_sent"] - cold_bytes
        assert warm_bytes < cold_bytes * 3  # three requests, each sending far fewer blocks
        if backend == "tcp":  # shm writes land without passing through the receiver
            assert pair.rx.stats()["bytes_received"] == pair.tx.stats()["bytes_sent"]
        assert pair.d.role.kv_blocks_skipped == 18
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("mode", ["layerwise", "full"])
@pytest.mark.parametrize("holder", ["decode_more", "decode_less"])
def test_prefill_and_decode_caches_may_differ(
    tiny_model_dir, shared_reference, backend, mode, holder
):
    """decode_more: only the decode worker holds the prefix, the prefill worker computes it
    all and sends the rest; decode_less: the prefill worker holds all 6 blocks, the decode
    worker 2, so blocks the prefill took from its own cache are sent too."""
    prefix, later = shared_prefix_prompts()
    pair = Pair(tiny_model_dir, backend, mode, long_prefill_token_threshold=6)
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        if holder == "decode_more":
            run(pair.d, [prefix])
            num_cached = 6
        else:
            run(pair.p, [prefix])
            run(pair.d, [prefix[:9]])
            num_cached = 2
        assert pair.generate(later) == shared_reference
        assert_only_new_blocks_sent(pair, num_cached)
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("stage", ["reserved", "mid_prefill"])
def test_abort_with_a_decode_prefix_hit_returns_every_reference(tiny_model_dir, backend, stage):
    prefix, later = shared_prefix_prompts()
    pair = Pair(tiny_model_dir, backend, "layerwise", long_prefill_token_threshold=6)
    try:
        run(pair.d, [prefix])
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        r = pair.d.reserve("a", later[3], GREEDY)
        assert r.num_cached_blocks == 6
        pool = pair.d.kv.pool
        assert [pool.ref_cnt[b] for b in r.block_ids] == [1] * len(r.block_ids)
        if stage == "mid_prefill":
            pair.p.add_prefill(
                "a", later[3], GREEDY, KVDestination(pair.rx.address(), r.block_ids, 6)
            )
            for _ in range(5):  # 30 of 40 tokens: block 6 sent (7 is partial)
                pair.p.step()
            assert pair.sent_dst["a"] == {r.block_ids[6]}
            pair.p.abort_request("a")
        assert pair.d.abort_request("a")
        assert all(pool.ref_cnt[b] == 0 for b in r.block_ids)
        assert pair.d.kv.num_free_blocks == free_d
        assert pair.rx.stats()["num_reservations"] == 0
        deadline = time.monotonic() + 10
        while pair.p.kv.num_free_blocks != free_p and time.monotonic() < deadline:
            pair.p.role.poll()
            time.sleep(0.005)
        assert pair.p.kv.num_free_blocks == free_p
        # The prefix is still cached: the next reservation takes the same blocks.
        assert pair.d.reserve("b", later[0], GREEDY).block_ids[:6] == r.block_ids[:6]
        pair.d.abort_request("b")
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_write_into_a_shared_cached_block_is_rejected(tiny_model_dir, backend):
    """The receiver expects only the new blocks: the cached ones other requests read are
    outside the reservation, and a sender that aims at them fails the request instead."""
    prefix, later = shared_prefix_prompts()
    pair = Pair(tiny_model_dir, backend, "full")
    try:
        run(pair.d, [prefix])
        free_d = pair.d.kv.num_free_blocks
        r = pair.d.reserve("a", later[0], GREEDY)
        cached = r.block_ids[0]
        before = pair.d.runner.kv_cache[:, cached].clone()
        pair.tx.send(pair.rx.address(), "a", [0, 1], [0], [cached], True)
        deadline = time.monotonic() + 10
        failed = []
        while not failed and time.monotonic() < deadline:
            failed = pair.d.role.poll()
            time.sleep(0.005)
        [(request_id, error)] = failed
        assert request_id == "a" and "outside the reservation" in error
        assert torch.equal(pair.d.runner.kv_cache[:, cached], before)
        assert pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


def test_abort_while_waiting_for_kv_frees_decode_blocks(tiny_model_dir):
    pair = Pair(tiny_model_dir, "tcp", "layerwise")
    try:
        free_d = pair.d.kv.num_free_blocks
        assert pair.d.reserve("a", [5] * 20, GREEDY)
        assert pair.d.kv.num_free_blocks < free_d
        assert pair.d.abort_request("a")
        assert pair.d.kv.num_free_blocks == free_d
    finally:
        pair.close()


def test_abort_mid_prefill_frees_prefill_blocks(tiny_model_dir):
    pair = Pair(tiny_model_dir, "tcp", "layerwise", long_prefill_token_threshold=4)
    try:
        free_p = pair.p.kv.num_free_blocks
        r = pair.d.reserve("a", list(range(2, 30)), GREEDY)
        pair.p.add_prefill(
            "a", list(range(2, 30)), GREEDY, KVDestination(pair.rx.address(), r.block_ids)
        )
        pair.p.step()  # first chunk sent
        pair.p.abort_request("a")
        pair.d.abort_request("a")
        deadline = time.monotonic() + 10
        while pair.p.kv.num_free_blocks != free_p and time.monotonic() < deadline:
            pair.p.role.poll()
            time.sleep(0.005)
        assert pair.p.kv.num_free_blocks == free_p
        assert not pair.p.has_unfinished_requests()
    finally:
        pair.close()


def test_wrong_number_of_destination_blocks_is_rejected(tiny_model_dir):
    pair = Pair(tiny_model_dir, "tcp", "full")
    try:
        with pytest.raises(ValueError, match="destination blocks"):
            pair.p.add_prefill(
                "a", [5] * 9, SamplingParams(), KVDestination(pair.rx.address(), [1])
            )
    finally:
        pair.close()


@pytest.mark.parametrize("kv, pool_dtype", [("fp8", torch.uint8), ("int8", torch.int8)])
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_8bit_blocks_and_scales_arrive_intact(tiny_model_dir, backend, kv, pool_dtype):
    """FP8 (or int8) on both sides moves bytes unchanged, so 1P1D equals a collocated engine
    of that KV dtype."""
    fp8 = Engine(config(kv, long_prefill_token_threshold=6), tiny_model_dir)
    assert fp8.runner.kv_cache.dtype is pool_dtype
    reference = [run(fp8, [p])[0] for p in prompts(4)]
    pair = Pair(tiny_model_dir, backend, "layerwise", kv, kv, long_prefill_token_threshold=6)
    try:
        assert pair.generate(prompts(4)) == reference
        sent = pair.tx.stats()["bytes_sent"]
        assert sent > 0
    finally:
        pair.close()


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_mixed_dtypes_convert_before_the_wire(tiny_model_dir, kv):
    """An fp32 prefill feeding an FP8 (int8) decode: blocks are quantized on the prefill side,
    so the decode side holds exactly what a collocated engine of that KV dtype would
    (unchunked prefill)."""
    fp8 = Engine(config(kv), tiny_model_dir)
    reference = [run(fp8, [p])[0] for p in prompts(4)]
    mixed = Pair(tiny_model_dir, "tcp", "full", "auto", kv)
    same = Pair(tiny_model_dir, "tcp", "full")
    try:
        assert mixed.generate(prompts(4)) == reference
        same.generate(prompts(4))
        ratio = mixed.tx.stats()["bytes_sent"] / same.tx.stats()["bytes_sent"]
        assert ratio == pytest.approx(20 / 64, rel=0.02)  # 8-bit row: 16 + 4 bytes, fp32: 64
    finally:
        mixed.close()
        same.close()


def test_fp8_prefill_into_fp32_decode_runs(tiny_model_dir):
    pair = Pair(tiny_model_dir, "shm", "layerwise", "fp8", "auto")
    try:
        outs = pair.generate(prompts(3))
        assert all(len(o) == GREEDY.max_tokens for o in outs)
    finally:
        pair.close()


def test_bf16_prefill_into_fp32_decode_converts_before_the_wire(tiny_model_dir):
    """A bf16 prefill role feeding an fp32 decode role: the first token is the bf16 engine's,
    and every prompt block lands on the decode side as the prefill's bf16 KV widened to fp32
    (exactly: every bf16 value is an fp32 value)."""
    bf16 = Engine(config(dtype="bfloat16"), tiny_model_dir)
    first = [run(bf16, [p])[0][0] for p in prompts(4)]
    pair = Pair(tiny_model_dir, "tcp", "full", p_model_dtype="bfloat16")
    try:
        assert pair.p.runner.kv_cache.dtype is torch.bfloat16
        outs = pair.generate(prompts(4))
        assert [o[0] for o in outs] == first
        assert all(len(o) == GREEDY.max_tokens for o in outs)
        # Decode appends into each prompt's last block: compare the blocks it does not touch.
        last = {max(r.block_ids) for r in pair.reservations.values()}
        pairs = sorted((s, d) for s, d in pair.sent_pairs if d not in last)
        assert pairs
        src, dst = (torch.tensor(ids) for ids in zip(*pairs))
        sent = pair.p.runner.kv_cache[:, src].float()
        assert torch.equal(pair.d.runner.kv_cache[:, dst], sent)
    finally:
        pair.close()
