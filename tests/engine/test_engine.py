"""End-to-end engine invariants on a tiny random-weight Llama (CPU, fp32)."""

import random

import pytest

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(
    model_dir, num_blocks=256, block_size=4, device=None, kv_cache_dtype="auto", **sched
) -> Engine:
    # 2 layers * 2 (K,V) * 2 kv heads * 16 dims * 4 bytes = 512 bytes per token (fp32).
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_bytes=num_blocks * block_size * 512,
        kv_cache_dtype=kv_cache_dtype,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            cache=cache,
            scheduler=SchedulerConfig(**sched),
            device=device or DeviceConfig(),
        ),
        model_dir=model_dir,
    )


def run(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, 128) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt run alone, unchunked, with plenty of blocks."""
    engine = make_engine(tiny_model_dir)
    return [run(engine, [p])[0] for p in prompts(6)]


def test_batch_equals_alone_and_blocks_return(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    free = engine.kv.num_free_blocks
    assert run(engine, prompts(6)) == reference
    assert engine.kv.num_free_blocks == free


def test_chunked_prefill_equals_unchunked(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, long_prefill_token_threshold=5, max_num_batched_tokens=7)
    assert run(engine, prompts(6)) == reference


def test_per_request_chunk_cap_gives_same_output(tiny_model_dir, reference):
    # The adaptive planner's SLO-sized chunk: a few requests capped at 3 prefill tokens a step
    # while others decode beside them; tokens are those of each prompt run alone.
    engine = make_engine(tiny_model_dir)
    reqs = [
        engine.add_request(str(i), p, GREEDY, prefill_chunk_tokens=3 if i % 2 else None)
        for i, p in enumerate(prompts(6))
    ]
    out = {str(i): [] for i in range(6)}
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[str(i)] for i in range(6)] == reference
    assert num_steps > 12 + max(len(r.prompt_token_ids) for r in reqs[1::2]) // 3 - 1


def test_a_stall_budget_gives_same_output(tiny_model_dir, reference):
    # The worker's stall guard caps prefills beside decodes at its measured rate (here a
    # budget so small every capped step takes the least chunk): tokens do not change.
    engine = make_engine(tiny_model_dir)
    waiting = list(enumerate(prompts(6)))
    out = {str(i): [] for i in range(6)}
    prefills_beside_decodes, num_steps = [], 0
    while waiting or engine.has_unfinished_requests():
        if waiting and num_steps % 3 == 0:  # each prompt joins running decodes
            i, p = waiting.pop(0)
            engine.add_request(str(i), p, GREEDY, stall_budget_s=1e-6)
        num_steps += 1
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        shape = engine.last_shape
        if shape.decode_requests and shape.prefill_tokens:
            prefills_beside_decodes.append(shape.prefill_tokens)
    assert [out[str(i)] for i in range(6)] == reference
    assert prefills_beside_decodes and max(prefills_beside_decodes) <= 32


def test_preemption_recompute_gives_same_output(tiny_model_dir, reference):
    # 24 blocks of 4 tokens cannot hold six requests of up to ~50 tokens at once.
    engine = make_engine(tiny_model_dir, num_blocks=24)
    assert run(engine, prompts(6)) == reference
    assert engine.kv.num_free_blocks == 24


def test_preemption_actually_happens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=24)
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0


def test_prefix_cache_hit_gives_same_output(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    shared = prompts(1, seed=5, lo=30, hi=31)[0]
    first = run(engine, [shared + [9, 9, 9]])
    cached = engine.add_request("again", shared + [9, 9, 9], GREEDY)
    toks = []
    while engine.has_unfinished_requests():
        toks += [t for o in engine.step() for t in o.new_token_ids]
    assert cached.num_cached_tokens == 32  # 8 full blocks of 4 of the 33-token prompt
    assert [toks] == first


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    p = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True
    )
    alone = run(engine, [[5, 6, 7]], p)
    batched = run(
        engine,
        [[9, 9], [5, 6, 7], [1, 2, 3, 4]],
        [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True), p, GREEDY],
    )
    assert batched[1] == alone[0]
    other_seed = run(
        engine,
        [[5, 6, 7]],
        SamplingParams(
            max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=43, ignore_eos=True
        ),
    )
    assert other_seed != alone


def test_top_k_one_is_greedy(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=12, temperature=0.7, top_k=1, ignore_eos=True)
    assert run(engine, prompts(6), p) == reference


def test_abort_frees_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    free = engine.kv.num_free_blocks
    engine.add_request("a", list(range(2, 30)), GREEDY)
    engine.add_request("b", list(range(2, 10)), GREEDY)
    engine.step()
    assert engine.kv.num_free_blocks < free
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert engine.kv.num_free_blocks == free and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, match",
    [([], "empty"), ([1] * 600, "context length"), ([1, 500], "token ids"), ([1, -3], "token ids")],
)
def test_bad_prompts_are_rejected(tiny_model_dir, prompt, match):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, GREEDY)


def test_stop_token_and_eos_stop_at_first_occurrence(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    ref = reference[0]
    stop = ref[4]
    out = run(
        engine,
        [prompts(1)[0]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True),
    )
    assert out[0] == ref[: ref.index(stop) + 1]
    eos_out = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=12, temperature=0.0))
    assert eos_out[0] == (ref[: ref.index(1) + 1] if 1 in ref else ref)


def test_resumed_seeded_request_continues_the_same_sample(tiny_model_dir):
    """A request resumed on another worker (its streamed tokens appended to the prompt)
    draws the same tokens as if it had never stopped."""
    engine = make_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    full = run(engine, [prompt], p)[0]
    resumed = engine.add_request(
        "resumed",
        prompt + full[:4],
        SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True),
        num_prior_output_tokens=4,
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert resumed.output_token_ids == full[4:]


def test_rope_tables_end_at_max_model_len(tiny_model_dir):
    """A KV pool shorter than the model's context caps max_model_len; the rope tables keep
    only the positions below it, and the last of them computes as with the whole table."""
    whole = make_engine(tiny_model_dir)
    short = make_engine(tiny_model_dir, num_blocks=16)  # 64 tokens
    assert short.max_model_len == 64 < whole.runner.model.rope_cos.shape[0]
    assert short.runner.model.rope_cos.shape[0] == short.runner.model.rope_sin.shape[0] == 64
    prompt = prompts(1, seed=3, lo=50, hi=51)[0]
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    assert run(short, [prompt], params) == run(whole, [prompt], params)  # positions 0-61
