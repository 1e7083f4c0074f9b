"""Structured outputs in the engine: sampled output follows its grammar (checked with
`jsonschema`, an independent validator), a finished grammar ends the request, and a
disaggregated request is token for token the collocated one."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from pdserve.engine.engine import Engine
from pdserve.grammar import grammar_of
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregation import Pair, config
from tests.engine.test_engine import run


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: string/integer/number/boolean/enum/array/nested-object properties,
    a random `required` subset. Strings and arrays are bounded and extra keys refused, so a
    random-weight model can close the document within its token budget."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    properties: dict[str, Any] = {}
    for index in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            prop: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 6)}
        elif kind == "integer":
            prop = {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 999)}
        elif kind == "number":
            prop = {"type": "number"}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", 7, None, True], rng.randint(1, 4))}
        elif kind == "array":
            items = rng.choice([{"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]}])
            prop = {"type": "array", "items": items, "maxItems": rng.randint(0, 3)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"{kind}_{index}"] = prop
    names = list(properties)
    required = rng.sample(names, rng.randint(0, len(names)))
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def engine(tiny_served_model):
    return Engine(config(), tiny_served_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_served_model):
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer(tiny_served_model)


def test_sampled_json_validates_against_50_generated_schemas(engine, tokenizer):
    rng = random.Random(38)
    schemas = [random_schema(rng) for _ in range(50)]
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=seed, grammar=grammar_of("json", s))
        for seed, s in enumerate(schemas)
    ]
    prompt = tokenizer.encode("Reply in JSON.")
    outputs = run(engine, [prompt] * len(schemas), params)
    num_stopped = 0
    for schema, tokens in zip(schemas, outputs):
        text = tokenizer.decode(tokens)
        if len(tokens) < 160:  # ended by the grammar (an EOS would be masked off before)
            jsonschema.validate(json.loads(text), schema)
            num_stopped += 1
    # Most end by themselves: a test where every output runs out of tokens proves nothing.
    assert num_stopped >= 40, num_stopped
    unconstrained = run(engine, [prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=0))
    with pytest.raises(ValueError):  # the same model, unconstrained, writes no JSON
        json.loads(tokenizer.decode(unconstrained[0]))


def test_a_finished_grammar_ends_the_request_with_stop(engine, tokenizer):
    grammar = grammar_of("choice", ["yes", "no"])
    engine.add_request(
        "c", tokenizer.encode("Well?"), SamplingParams(max_tokens=50, grammar=grammar)
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    text = tokenizer.decode([t for o in outputs for t in o.new_token_ids])
    assert text in ("yes", "no")
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_a_grammar_the_tokenizer_cannot_run_is_refused_at_admission(engine):
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(grammar="not a grammar {"))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_disaggregated_equals_collocated(tiny_served_model, engine, tokenizer, temperature):
    """The prefill worker samples the first token under the grammar; the decode worker
    replays it into its own matcher and goes on: the same tokens as one engine."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(4)]
    prompt = tokenizer.encode("JSON please:")
    pair = Pair(tiny_served_model, "tcp", "layerwise")
    try:
        for seed, schema in enumerate(schemas):
            params = SamplingParams(
                max_tokens=60,
                temperature=temperature,
                seed=seed,
                grammar=grammar_of("json", schema),
            )
            collocated = run(engine, [prompt], params)[0]
            assert pair.generate([prompt], params)[0] == collocated
            assert len(collocated) > 1  # the decode worker sampled too
    finally:
        pair.close()
