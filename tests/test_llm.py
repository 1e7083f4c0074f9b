"""The offline API's cache warm-up: strings, token ids and chat message lists."""

import pytest

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

SYSTEM = "".join(chr(60 + i % 50) for i in range(40))  # 40 byte tokens: 2 full blocks of 16


@pytest.fixture
def llm(tiny_served_model):
    return LLM(str(tiny_served_model), kv_cache_bytes=64 * 16 * 512)


def test_warmup_pins_and_the_first_request_hits(llm):
    chat = [{"role": "system", "content": SYSTEM}]
    assert llm.warmup([SYSTEM, chat]) == [32, 48]  # the template adds 10+ tokens around it
    assert llm.engine.kv.pool.num_pinned_blocks == 2 + 3  # the chat starts with its own tokens
    out = llm.generate(SYSTEM + "Go.", SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.finish_reason == "length"
    assert llm.engine.kv.counters.cached_prompt_tokens == 32
    assert llm.unpin([SYSTEM, chat]) == [32, 48]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_warmup_refused_beyond_the_pinned_share(llm):
    assert llm.warmup(["x" * 400]) == [400]  # 25 of 64 blocks
    with pytest.raises(ValueError, match="cannot pin 25 more blocks: 25 of at most 32 pinned"):
        llm.warmup(["y" * 400])
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks - 25
    assert llm.warmup("hello", pin=False) == [0]  # shorter than a block: nothing to keep
