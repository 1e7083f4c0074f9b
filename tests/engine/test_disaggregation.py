"""A prefill engine and a decode engine in one process, joined by a real KV transfer,
produce exactly the collocated engine's greedy output — for every backend and mode, with
chunked prefill and prefix hits on the prefill side — and leak no block on either side."""

import time

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import num_kv_blocks
from pdserve.model.config import ModelConfig
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.registry import make_receiver, make_sender
from pdserve.transfer.shm import create_shared_kv
from tests.engine.test_engine import GREEDY, prompts, run

SECRET = b"k" * 32
NUM_BLOCKS, BLOCK_SIZE = 128, 4


def config(kv_cache_dtype="auto", **sched) -> EngineConfig:
    cache = CacheConfig(
        block_size=BLOCK_SIZE, kv_cache_bytes=NUM_BLOCKS * BLOCK_SIZE * 512,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return EngineConfig(model="tiny", cache=cache, scheduler=SchedulerConfig(**sched))


class Pair:
    def __init__(self, model_dir, backend, mode, p_dtype="auto", d_dtype="auto", **sched) -> None:
        row, kind = (20, "uint8") if d_dtype == "fp8" else (16, "float32")
        cfg = config(d_dtype)
        mc = ModelConfig.from_dir(model_dir)
        num_blocks = num_kv_blocks(mc, cfg.cache, torch.device("cpu"), torch.float32)
        layout = KVLayout(2, num_blocks, BLOCK_SIZE, 2, row, kind)
        kv = create_shared_kv(layout)[0] if backend != "tcp" else None
        self.d = Engine(cfg, model_dir, role="decode", kv_cache=kv)
        self.rx = make_receiver(backend, self.d.runner.kv_cache, layout, SECRET)
        self.d.attach_receiver(self.rx)
        self.p = Engine(config(p_dtype, **sched), model_dir, role="prefill")
        wire = self.p.wire_source(d_dtype)
        source = wire.kv if wire else self.p.runner.kv_cache
        self.tx = make_sender(backend, source, KVLayout.from_tensor(source), SECRET)
        self.p.attach_sender(self.tx, mode, wire)

    def close(self):
        self.tx.close()
        self.rx.close()

    def generate(self, prompt_sets: list[list[int]], params=GREEDY) -> list[list[int]]:
        """Plays the router: reserve on D, prefill on P, hand the first token to D."""
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompt_sets):
            rid = f"r{i}-{time.monotonic_ns()}"
            r = self.d.reserve(rid, prompt, params)
            assert r is not None
            self.p.add_prefill(
                rid, prompt, params, self.rx.address(), r.block_ids, r.num_cached_blocks
            )
            out[rid] = []
        pending = set(out)
        deadline = time.monotonic() + 30
        while pending and time.monotonic() < deadline:
            assert self.p.poll_transfers() == [] and self.d.poll_transfers() == []
            if self.p.has_unfinished_requests():
                for o in self.p.step():
                    out[o.request_id] += o.new_token_ids
                    if o.finish_reason is FinishReason.HANDOFF:
                        self.d.start_decode(o.request_id, o.new_token_ids[0])
                    else:
                        self.d.abort_request(o.request_id)
                        pending.discard(o.request_id)
            if self.d.has_unfinished_requests():
                for o in self.d.step():
                    out[o.request_id] += o.new_token_ids
                    if o.finished:
                        pending.discard(o.request_id)
            else:
                time.sleep(0.001)
        # Let the prefill side see its sends confirmed and free its blocks.
        while self.p.prefill_handoff.sending and time.monotonic() < deadline:
            self.p.poll_transfers()
            time.sleep(0.001)
        assert not pending, "requests did not finish"
        return list(out.values())


@pytest.fixture(scope="module")
def collocated(tiny_model_dir):
    engine = Engine(config(), tiny_model_dir)
    return [run(engine, [p])[0] for p in prompts(5)]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_disaggregated_equals_collocated(tiny_model_dir, collocated, backend, mode):
    pair = Pair(tiny_model_dir, backend, mode, long_prefill_token_threshold=6)  # chunked
    try:
        free_p, free_d = pair.p.kv.num_free_blocks, pair.d.kv.num_free_blocks
        assert pair.generate(prompts(5)) == collocated
        # Again: the prefill side now hits its prefix cache and still sends every block.
        assert pair.generate(prompts(5)) == collocated
        assert pair.p.kv.num_free_blocks == free_p and pair.d.kv.num_free_blocks == free_d
        assert pair.tx.stats()["num_writes"] > 0
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
        pair.p.add_prefill("a", list(range(2, 30)), GREEDY, pair.rx.address(), r.block_ids)
        pair.p.step()  # first chunk sent
        pair.p.abort_request("a")
        pair.d.abort_request("a")
        deadline = time.monotonic() + 10
        while pair.p.kv.num_free_blocks != free_p and time.monotonic() < deadline:
            pair.p.poll_transfers()
            time.sleep(0.005)
        assert pair.p.kv.num_free_blocks == free_p
        assert not pair.p.has_unfinished_requests()
    finally:
        pair.close()


def test_wrong_number_of_destination_blocks_is_rejected(tiny_model_dir):
    pair = Pair(tiny_model_dir, "tcp", "full")
    try:
        with pytest.raises(ValueError, match="destination blocks"):
            pair.p.add_prefill("a", [5] * 9, SamplingParams(), pair.rx.address(), [1])
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_fp8_blocks_and_scales_arrive_intact(tiny_model_dir, backend):
    """FP8 on both sides moves bytes unchanged, so 1P1D equals a collocated FP8 engine."""
    fp8 = Engine(config("fp8", long_prefill_token_threshold=6), tiny_model_dir)
    assert fp8.runner.kv_cache.dtype is torch.uint8
    reference = [run(fp8, [p])[0] for p in prompts(4)]
    pair = Pair(tiny_model_dir, backend, "layerwise", "fp8", "fp8", long_prefill_token_threshold=6)
    try:
        assert pair.generate(prompts(4)) == reference
        sent = pair.tx.stats()["bytes_sent"]
        assert sent > 0
    finally:
        pair.close()


def test_mixed_dtypes_convert_before_the_wire(tiny_model_dir):
    """An fp32 prefill feeding an FP8 decode: blocks are quantized on the prefill side, so
    the decode side holds exactly what a collocated FP8 engine would (unchunked prefill)."""
    fp8 = Engine(config("fp8"), tiny_model_dir)
    reference = [run(fp8, [p])[0] for p in prompts(4)]
    mixed = Pair(tiny_model_dir, "tcp", "full", "auto", "fp8")
    same = Pair(tiny_model_dir, "tcp", "full")
    try:
        assert mixed.generate(prompts(4)) == reference
        same.generate(prompts(4))
        ratio = mixed.tx.stats()["bytes_sent"] / same.tx.stats()["bytes_sent"]
        assert ratio == pytest.approx(20 / 64, rel=0.02)  # FP8 row: 16 + 4 bytes, fp32: 64
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
