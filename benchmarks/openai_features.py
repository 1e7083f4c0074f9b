"""What the OpenAI request features cost on the real model, each against the same work without
it, the order alternating round by round, medians after a warm-up (BENCHMARKS.md, "OpenAI
features", says what each mode times).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from pdserve.grammar import grammar_of
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

# Open-ended on purpose: a list of strings the model can go on writing, so the batch stays
# whole for the measured steps.
LIST_SCHEMA = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
    "required": ["fruits"],
}
LIST_PROMPT = [{"role": "user", "content": "List forty fruits as JSON, with a long note on each."}]
RECORD_SCHEMA = {
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
RECORD = {
    "name": "Ada Lovelace of the Analytical Engine",
    "age": 36,
    "score": 98.25,
    "active": True,
    "tags": ["mathematics", "poetry", "notes on the engine", "bernoulli numbers"],
    "kind": "beta",
    "address": {"city": "London, St James's Square", "zip": 12345},
}
SAMPLING = {
    "plain": {},
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    | dict(logit_bias=tuple((t, -1.0) for t in range(100, 116)), min_tokens=8),
    "logprobs": dict(logprobs=5),
}


def load(args: argparse.Namespace) -> LLM:
    return LLM(args.model, **({"threads": args.threads} if args.threads else {}))


def interleaved(names: list[str], rounds: int, run: Callable[[str, int], object]) -> dict:
    """`run(name, round)` for every name each round, the order reversed every other round."""
    results: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run(name, r))
    return results


def run_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams, clock=None) -> list:
    """(step seconds, grammar seconds) of each decode step while every request runs."""
    engine = llm.engine
    tag = time.monotonic_ns()
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
        if clock is not None:
            clock.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        if decoding and not any(r.is_finished for r in requests):
            times.append((time.perf_counter() - start, clock.seconds if clock else 0.0))
    return times


class GrammarClock:
    """Wraps the engine's grammar hooks and adds up the seconds they take."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        grammars = llm.engine.runner.grammars
        begin = grammars.begin

        def timed_begin(requests):
            start = time.perf_counter()
            masks = begin(requests)
            if masks is not None:
                masks.apply, masks.accept = self._timed(masks.apply), self._timed(masks.accept)
            self.seconds += time.perf_counter() - start
            return masks

        grammars.begin = timed_begin

    def _timed(self, fn):
        def call(*args):
            start = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - start

        return call


def grammar(args: argparse.Namespace) -> None:
    llm = load(args)
    prompt = llm.tokenizer.apply_chat_template(LIST_PROMPT)
    greedy, schema = dict(max_tokens=args.tokens, temperature=0.0), grammar_of("json", LIST_SCHEMA)
    plain = SamplingParams(**greedy, ignore_eos=True)
    params = {"plain": plain, "grammar": SamplingParams(**greedy, grammar=schema)}
    clock = GrammarClock(llm)
    for batch in map(int, args.batches.split(",")):
        prompts = [prompt] * batch
        run_steps(llm, prompts, params["grammar"], clock)  # warm-up: compile, tables
        runs = interleaved(
            list(params),
            args.rounds,
            lambda name, _, p=prompts: run_steps(llm, p, params[name], clock),
        )
        steps = {name: [s for one in r for s in one] for name, r in runs.items()}
        tpot = {name: statistics.median(s for s, _ in st) * 1e3 for name, st in steps.items()}
        share = statistics.median(g / s for s, g in steps["grammar"]) * 100
        grammar_ms = statistics.median(g for _, g in steps["grammar"]) * 1e3
        print(
            f"batch {batch:2d}: TPOT plain {tpot['plain']:.2f} ms, JSON schema "
            f"{tpot['grammar']:.2f} ms; grammar work {grammar_ms:.3f} ms a step, {share:.2f}% "
            f"of its step; steps timed {[len(st) for st in steps.values()]}"
        )


def llguidance_walk(hf_tokenizer, vocab_size: int):
    import llguidance
    import llguidance.hf
    import numpy as np

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    start = time.perf_counter()
    compiled = llguidance.LLMatcher.grammar_from_json_schema(RECORD_SCHEMA)
    llguidance.LLMatcher(tokenizer, compiled)
    compile_s = time.perf_counter() - start
    mask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def step(matcher, token: int) -> None:
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        assert matcher.consume_token(token), matcher.get_error()

    return lambda: llguidance.LLMatcher(tokenizer, compiled), step, compile_s


def xgrammar_walk(hf_tokenizer, vocab_size: int):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(RECORD_SCHEMA))
    compile_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def step(matcher, token: int) -> None:
        matcher.fill_next_token_bitmask(mask, 0)
        assert matcher.accept_token(token)

    return lambda: xgrammar.GrammarMatcher(compiled), step, compile_s


def mask(args: argparse.Namespace) -> None:
    from pdserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    tokens = tokenizer.encode(json.dumps(RECORD))
    walks = {}
    for name, make in (("llguidance", llguidance_walk), ("xgrammar", xgrammar_walk)):
        try:
            walks[name] = make(tokenizer._tokenizer, tokenizer.vocab_size)
        except ImportError:
            print(f"{name}: not installed, skipped")

    def walk(name: str, _) -> float:
        matcher, step, _ = walks[name][0](), *walks[name][1:]
        start = time.perf_counter()
        for token in tokens:
            step(matcher, token)
        return (time.perf_counter() - start) / len(tokens)

    interleaved(list(walks), 1, walk)  # warm-up: lazy tables, first-use allocations
    print(f"vocabulary {tokenizer.vocab_size}, {len(tokens)} tokens a walk")
    for name, times in interleaved(list(walks), args.rounds, walk).items():
        print(
            f"{name:10s} compile {walks[name][2] * 1e3:.1f} ms, mask + accept: median "
            f"{statistics.median(times) * 1e6:7.1f} us/token (range "
            f"{(max(times) - min(times)) * 1e6:.1f})"
        )


def sampling(args: argparse.Namespace) -> None:
    llm = load(args)
    rng, vocab = random.Random(0), llm.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(200, vocab) for _ in range(args.prompt_len or 128)]
        for _ in range(args.batch)
    ]
    base = dict(max_tokens=args.tokens, seed=1, temperature=0.8, top_p=0.95, ignore_eos=True)
    params = {name: SamplingParams(**base, **extra) for name, extra in SAMPLING.items()}
    run_steps(llm, prompts, params["plain"])  # fills the prefix cache

    def mean_ms(name: str, _) -> float:
        return statistics.mean(s for s, _ in run_steps(llm, prompts, params[name])) * 1e3

    results = interleaved(list(SAMPLING), args.rounds, mean_ms)
    print(f"batch {args.batch}, {args.tokens} tokens: median per-round mean decode step")
    for name, values in results.items():
        added = statistics.median((v - p) / p * 100 for v, p in zip(values, results["plain"]))
        print(f"{name:>10}: {statistics.median(values):7.2f} ms/step  {added:+5.1f}% vs plain")


def prompt_logprobs(args: argparse.Namespace) -> None:
    llm, length = load(args), args.prompt_len or 512
    rng, vocab = random.Random(0), llm.engine.model_config.vocab_size
    params = {
        "plain": SamplingParams(max_tokens=1, temperature=0.0),
        "prompt_logprobs": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5),
    }

    def prefill_ms(name: str, _) -> float:  # a fresh prompt: no prefix-cache hit either way
        prompt = [rng.randrange(200, vocab) for _ in range(length)]
        start = time.perf_counter()
        llm.engine.add_request(f"{name}-{time.monotonic_ns()}", prompt, params[name])
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        return (time.perf_counter() - start) * 1e3

    interleaved(list(params), 1, prefill_ms)  # warm-up
    plain, scored = interleaved(list(params), args.rounds, prefill_ms).values()
    ratio = statistics.median(s / p for s, p in zip(scored, plain))
    print(
        f"prompt {length} tokens: plain {statistics.median(plain):.1f} ms, prompt_logprobs=5 "
        f"{statistics.median(scored):.1f} ms, x{ratio:.2f}"
    )


MODES = {"grammar": grammar, "mask": mask, "sampling": sampling, "prompt-logprobs": prompt_logprobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=0, help="0: the engine's default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens a request")
    parser.add_argument("--batches", default="1,32", help="grammar: batch sizes")
    parser.add_argument("--batch", type=int, default=32, help="sampling: requests a step")
    parser.add_argument("--prompt-len", type=int, help="sampling: 128, prompt-logprobs: 512")
    args = parser.parse_args()
    print(f"{args.mode}, {args.model}, {args.rounds} rounds")
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
