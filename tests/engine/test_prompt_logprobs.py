"""Prompt logprobs (completions' `echo` with `logprobs`): the prefill scores every prompt
token after the first, chunk by chunk, bypassing the prefix cache, and a prefill worker's
equal a collocated engine's. The reference is a plain forward of the model over the whole
prompt, its log_softmax gathered at each next token."""

from dataclasses import replace

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.model import logprobs as logprobs_module
from pdserve.model.loader import load_model
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregation import Pair, config
from tests.engine.test_engine import prompts
from tests.model.test_llama import our_logits

ECHO = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=3)


def reference(model_dir, prompt: list[int], num_top: int) -> list:
    """[None, [logprob of token t, [[id, logprob] x num_top]] for t = 1..]."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(our_logits(load_model(model_dir), prompt), dim=-1)
    out: list = [None]
    for position, token in enumerate(prompt[1:]):
        values, ids = torch.topk(logprobs[position], num_top)
        top = [[i, v] for i, v in zip(ids.tolist(), values.tolist())]
        out.append([logprobs[position, token].item(), top])
    return out


def assert_close(found: list, expected: list) -> None:
    assert len(found) == len(expected) and found[0] is None
    for (value, top), (ref_value, ref_top) in zip(found[1:], expected[1:]):
        assert value == pytest.approx(ref_value, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)


def first_outputs(engine: Engine, requests: dict[str, list[int]], params=ECHO) -> dict:
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    firsts = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            firsts.setdefault(output.request_id, output)
            if output.request_id in firsts and firsts[output.request_id] is not output:
                assert output.prompt_logprobs is None  # sent once, with the first token
    return firsts


def test_chunked_prompt_logprobs_equal_a_full_forward(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(logprobs_module, "PROMPT_SLICE_ROWS", 5)  # several slices per chunk
    engine = Engine(config(long_prefill_token_threshold=7), tiny_model_dir)
    batch = {str(i): p for i, p in enumerate(prompts(4, lo=20, hi=40))}
    firsts = first_outputs(engine, batch)
    for request_id, prompt in batch.items():
        assert_close(firsts[request_id].prompt_logprobs, reference(tiny_model_dir, prompt, 3))
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks  # nothing leaked


def test_a_cached_prompt_is_recomputed_for_its_logprobs(tiny_model_dir):
    """Positions served from the prefix cache were never scored: a request asking for prompt
    logprobs skips the cache for its reads (and still fills it for the others)."""
    engine = Engine(config(), tiny_model_dir)
    prompt = prompts(1, lo=30, hi=31)[0]
    plain = replace(ECHO, prompt_logprobs=None)
    assert first_outputs(engine, {"warm": prompt}, plain)["warm"].prompt_logprobs is None
    again = first_outputs(engine, {"echo": prompt})["echo"]
    assert again.num_cached_tokens == 0
    assert_close(again.prompt_logprobs, reference(tiny_model_dir, prompt, 3))
    assert first_outputs(engine, {"hit": prompt}, plain)["hit"].num_cached_tokens == 28


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "decode-holds-prefix"])
def test_a_prefill_worker_sends_the_collocated_prompt_logprobs(tiny_model_dir, cached):
    batch = prompts(3, lo=12, hi=30)
    engine = Engine(config(), tiny_model_dir)
    collocated = first_outputs(engine, {str(i): p for i, p in enumerate(batch)})
    pair = Pair(tiny_model_dir, "shm", "full", long_prefill_token_threshold=6)
    seen = []
    step = pair.p.step

    def recording_step():
        outputs = step()
        seen.extend(o for o in outputs if o.finish_reason is FinishReason.HANDOFF)
        return outputs

    pair.p.step = recording_step
    try:
        if cached:  # D's cache holds the prompts: P is told to skip nothing all the same
            pair.generate(batch, replace(ECHO, prompt_logprobs=None))
            seen.clear()
        tokens = pair.generate(batch, ECHO)
    finally:
        pair.close()
    assert [out[0] for out in tokens] == [collocated[str(i)].new_token_ids[0] for i in range(3)]
    seen.sort(key=lambda o: o.request_id)  # Pair's ids: r<index>-<time>
    assert len(seen) == len(batch)
    for index, (output, prompt) in enumerate(zip(seen, batch)):
        assert_close(output.prompt_logprobs, collocated[str(index)].prompt_logprobs)
        assert_close(output.prompt_logprobs, reference(tiny_model_dir, prompt, 3))
