"""Per-token cost of a grammar's token mask, llguidance against xgrammar, on one tokenizer.

Each library walks the same valid JSON document token by token under the same JSON schema:
at every step it fills a [1, V/32] int32 bitmask and accepts the next token. Rounds alternate
between the libraries (the machine drifts; alternation makes the ratio fair) and the median
of the per-round means is reported. A library that is not installed is skipped. Each library's
compile time (schema to a ready matcher, once) is printed too.

    .venv/bin/python benchmarks/grammar_mask_cost.py [--model smollm2-135m] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "score", "active", "tags", "kind", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace of the Analytical Engine",
    "age": 36,
    "score": 98.25,
    "active": True,
    "tags": ["mathematics", "poetry", "notes on the engine", "bernoulli numbers"],
    "kind": "beta",
    "address": {"city": "London, St James's Square", "zip": 12345},
}


def llguidance_walk(hf_tokenizer, vocab_size: int):
    import llguidance
    import llguidance.hf

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    llguidance.LLMatcher(tokenizer, grammar)
    print(f"llguidance compile: {(time.perf_counter() - start) * 1e3:.1f} ms")
    mask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def walk(tokens: list[int]) -> float:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        start = time.perf_counter()
        for token in tokens:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            assert matcher.consume_token(token), matcher.get_error()
        return (time.perf_counter() - start) / len(tokens)

    return walk


def xgrammar_walk(hf_tokenizer, vocab_size: int):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    print(f"xgrammar compile: {(time.perf_counter() - start) * 1e3:.1f} ms")
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def walk(tokens: list[int]) -> float:
        matcher = xgrammar.GrammarMatcher(compiled)
        start = time.perf_counter()
        for token in tokens:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(token)
        return (time.perf_counter() - start) / len(tokens)

    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from pdserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    hf = tokenizer._tokenizer
    text = json.dumps(DOCUMENT, indent=None)
    tokens = tokenizer.encode(text)
    walks = {}
    for name, make in (("llguidance", llguidance_walk), ("xgrammar", xgrammar_walk)):
        try:
            walks[name] = make(hf, tokenizer.vocab_size)
        except ImportError:
            print(f"{name}: not installed, skipped")
    for walk in walks.values():
        walk(tokens)  # warm-up: lazy tables, first-use allocations
    per_round: dict[str, list[float]] = {name: [] for name in walks}
    for _ in range(args.rounds):
        for name, walk in walks.items():
            per_round[name].append(walk(tokens))
    print(f"vocabulary {tokenizer.vocab_size}, {len(tokens)} tokens a walk, {args.rounds} rounds")
    for name, times in per_round.items():
        median = statistics.median(times) * 1e6
        spread = (max(times) - min(times)) * 1e6
        print(f"{name:10s} mask + accept: median {median:7.1f} us/token (range {spread:.1f})")


if __name__ == "__main__":
    main()
