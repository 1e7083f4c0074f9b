"""Token dropping under a KV budget, on a tiny model: the budget holds at every step, the
sink and the most recent blocks stay, and a budget that is never reached changes nothing."""

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import prompts

BS = 4


def engine(model_dir, **cache) -> Engine:
    cfg = CacheConfig(
        block_size=BS, kv_cache_bytes=256 * BS * 512, kv_sink_tokens=4, kv_recent_tokens=8, **cache
    )
    return Engine(EngineConfig(model="tiny", cache=cfg), model_dir)


def params(budget=None) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, kv_budget_tokens=budget)


def test_budget_holds_at_every_step_and_sink_recent_are_kept(tiny_model_dir):
    eng = engine(tiny_model_dir)
    reqs = [eng.add_request(str(i), p, params(32)) for i, p in enumerate(prompts(3, lo=20, hi=30))]
    first_blocks = {}
    while eng.has_unfinished_requests():
        running = list(eng.scheduler.running)
        eng.step()
        for r in running:
            if r.block_ids:
                first_blocks.setdefault(r.request_id, r.block_ids[0])
                assert len(r.block_ids) <= 32 // BS
                assert r.block_ids[0] == first_blocks[r.request_id]  # the sink block stays
                assert r.num_kv_tokens <= 32
    for r in reqs:
        assert len(r.output_token_ids) == 40
        assert r.num_dropped_tokens > 0 and r.num_dropped_tokens % BS == 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.runner.block_scores == {}


def test_recent_blocks_are_the_newest(tiny_model_dir):
    eng = engine(tiny_model_dir)
    r = eng.add_request("a", prompts(1, lo=20, hi=21)[0], params(32))
    allocated: list[int] = []
    while not r.is_finished:
        eng.step()
        if r.block_ids and (not allocated or allocated[-1] != r.block_ids[-1]):
            allocated.append(r.block_ids[-1])  # blocks are only ever appended at the end
        if r.num_dropped_tokens and not r.is_finished:
            # the 2 recent blocks and the one being filled are the last 3 allocated
            assert r.block_ids[-3:] == allocated[-3:]


def test_budget_not_reached_changes_nothing(tiny_model_dir):
    eng = engine(tiny_model_dir)
    prompt = prompts(1, lo=10, hi=11)[0]

    def run(p):
        req = eng.add_request(f"x{id(p)}", prompt, p)
        while eng.has_unfinished_requests():
            eng.step()
        return req

    plain, budgeted = run(params()), run(params(1024))
    assert budgeted.output_token_ids == plain.output_token_ids
    assert budgeted.num_dropped_tokens == 0


def test_deployment_default_and_bad_budget(tiny_model_dir):
    eng = engine(tiny_model_dir, kv_budget_tokens=40)
    assert eng.add_request("d", [5, 6, 7], SamplingParams()).kv_budget_tokens == 40
    with pytest.raises(ValueError, match="KV budget"):
        eng.add_request("e", [5, 6, 7], params(8))


@pytest.mark.parametrize("prompt_len", [32, 29])
def test_a_prompt_at_its_budget_is_dropped_by_its_scores(tiny_model_dir, prompt_len):
    """32 tokens under a 32-token budget: the first token opens a 9th block, so a block
    goes right after the prompt; 29 under 30 (7 blocks of budget): the 8th block is over.
    Either way the prompt's window scores rank it (they used to be computed only for
    prompts longer than the budget, so these dropped by all-zero scores)."""
    eng = engine(tiny_model_dir)
    budget = 32 if prompt_len == 32 else 30
    r = eng.add_request("a", prompts(1, lo=prompt_len, hi=prompt_len + 1)[0], params(budget))
    eng.step()  # the whole prompt in one chunk, then the drop
    assert r.num_dropped_tokens == BS
    assert float(eng.runner.block_scores["a"].sum()) > 0
