"""The time.time() stamps an engine hands the router for the TTFT breakdown: prefill start and
end with a request's first output only (a chunked prompt spans steps), the KV landing with a
decode engine's first output; none with later outputs."""

from __future__ import annotations

import time

from pdserve.engine.roles.base import KVDestination
from pdserve.request import FinishReason
from tests.engine.test_disaggregation import Pair
from tests.engine.test_engine import GREEDY, make_engine


def test_first_output_of_a_chunked_prefill_carries_its_span(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    before = time.time()
    engine.add_request("r", list(range(2, 30)), GREEDY)  # 28 tokens: 4 chunks of 8 at most
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    first, *rest = outputs
    stamps = first.stamps
    assert before <= stamps["prefill_start"] < stamps["prefill_end"] <= time.time()
    assert set(stamps) == {"prefill_start", "prefill_end"}
    assert all(o.stamps is None for o in rest) and len(rest) == GREEDY.max_tokens - 1


def test_decode_engine_stamps_the_kv_landing(tiny_model_dir):
    pair = Pair(tiny_model_dir, "shm", "layerwise")
    try:
        prompt = list(range(2, 30))
        r = pair.d.reserve("r", prompt, GREEDY)
        pair.p.add_prefill("r", prompt, GREEDY, KVDestination(pair.rx.address(), r.block_ids))
        (first,) = pair.p.step()
        assert first.finish_reason is FinishReason.HANDOFF
        assert set(first.stamps) == {"prefill_start", "prefill_end"}
        pair.d.role.start("r", first.new_token_ids[0])
        decoded = []
        deadline = time.monotonic() + 10
        while not decoded and time.monotonic() < deadline:
            pair.p.role.poll()
            pair.d.role.poll()
            decoded = pair.d.step() if pair.d.has_unfinished_requests() else []
        assert decoded, "the KV never landed"
        assert set(decoded[0].stamps) == {"kv_landed"}
        # Layer-wise: the prefill ends at its last layer, before the KV of that layer landed.
        assert first.stamps["prefill_end"] <= decoded[0].stamps["kv_landed"]
        pair.d.abort_request("r")
    finally:
        pair.close()
