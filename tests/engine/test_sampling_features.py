"""Penalties, logit_bias and min_tokens across the P/D hand-over: the prefill worker samples
the first token, the decode worker the rest from the prompt and output ids it holds, and the
whole is token for token the collocated engine's output, greedy and seeded."""

from dataclasses import replace

import pytest

from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregation import Pair, config
from tests.engine.test_engine import make_engine, prompts, run

PENALIZED = dict(
    max_tokens=12,
    repetition_penalty=1.6,
    presence_penalty=0.4,
    frequency_penalty=0.7,
    logit_bias=((5, 4.0), (9, -100.0)),
    min_tokens=6,
)
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, **PENALIZED),
    "seeded": SamplingParams(temperature=0.9, seed=1234, **PENALIZED),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_disaggregated_penalties_equal_collocated(tiny_model_dir, kind):
    params = PARAMS[kind]
    collocated = run(Engine(config(), tiny_model_dir), prompts(5), params)
    plain = run(Engine(config(), tiny_model_dir), prompts(5), _without_processing(params))
    assert collocated != plain  # the processing changes what is generated
    assert all(9 not in out for out in collocated)  # biased to -100: never drawn
    pair = Pair(tiny_model_dir, "shm", "full", long_prefill_token_threshold=6)
    try:
        assert pair.generate(prompts(5), params) == collocated
        # Again, with both prefix caches hit: the same tokens.
        assert pair.generate(prompts(5), params) == collocated
    finally:
        pair.close()


def test_min_tokens_holds_back_eos(tiny_model_dir):
    """Token 1 is the tiny model's EOS: biased up it ends every request at once, unless
    min_tokens holds it back."""
    engine = Engine(config(), tiny_model_dir)
    eos_first = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((1, 100.0),))
    assert run(engine, prompts(3), eos_first) == [[1]] * 3
    held = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((1, 100.0),), min_tokens=5)
    assert [len(out) for out in run(engine, prompts(3), held)] == [6, 6, 6]


def test_penalized_requests_survive_preemption(tiny_model_dir):
    """Recomputed after preemption, a request rebuilds its penalties from the same ids."""
    params = PARAMS["seeded"]
    reference = [run(make_engine(tiny_model_dir), [p], params)[0] for p in prompts(6)]
    engine = make_engine(tiny_model_dir, num_blocks=24)
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts(6))]
    out = {str(i): [] for i in range(6)}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert sum(r.num_preemptions for r in requests) > 0
    assert list(out.values()) == reference


def test_a_logit_bias_id_past_the_vocabulary_is_refused(tiny_model_dir):
    engine = Engine(config(), tiny_model_dir)
    params = SamplingParams(logit_bias=((128, 1.0),))
    with pytest.raises(ValueError, match="logit_bias token ids must be < vocab size 128"):
        engine.add_request("r", [3, 4], params)


def _without_processing(params: SamplingParams) -> SamplingParams:
    return replace(
        params,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logit_bias=(),
        min_tokens=0,
    )


def test_logprobs_are_of_the_raw_distribution_before_penalties(tiny_model_dir):
    """The same first token's logprobs with and without processing: they describe the model."""
    reported = []
    for params in (PARAMS["greedy"], _without_processing(PARAMS["greedy"])):
        engine = Engine(config(), tiny_model_dir)
        engine.add_request("r", prompts(1)[0], replace(params, logprobs=3))
        while not engine.step():
            pass
        reported.append(engine.runner.logprobs["r"])
    assert reported[0][1] == reported[1][1]  # the alternatives; the chosen tokens differ
    chosen, top = reported[1]
    assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and chosen == top[0][1]
