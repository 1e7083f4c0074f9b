"""Per-token overhead of a JSON-schema grammar on decode steps, at batch 1 and 32.

One in-process engine (the default model unless --model). Each round runs the batch twice,
unconstrained and under a JSON schema, in alternating order (the machine drifts; alternation
cancels it), and times every decode step whose batch is still whole. Reported: the median
decode step (TPOT) of each, and, measured inside the constrained steps themselves (so drift
and other load cancel), the grammar's own time per step (catch-up, mask fill, masking,
accept) as a share of that step's TPOT: on a shared machine the TPOT difference between
runs is noise, the in-step share is not.

    .venv/bin/python benchmarks/grammar_overhead.py [--rounds 5] [--batches 1,32] [--tokens 48]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from pdserve.grammar import grammar_of
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

# Open-ended on purpose: a list of strings the model can go on writing, so the batch stays
# whole for the measured steps.
SCHEMA = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
    "required": ["fruits"],
}
PROMPT = [{"role": "user", "content": "List forty fruits as JSON, with a long note on each."}]


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
                masks.apply = self._timed(masks.apply)
                masks.accept = self._timed(masks.accept)
            self.seconds += time.perf_counter() - start
            return masks

        grammars.begin = timed_begin

    def _timed(self, fn):
        def call(*args):
            start = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - start

        return call


def decode_steps(
    llm: LLM, prompt_ids: list[int], batch: int, params: SamplingParams, clock: GrammarClock
) -> list[tuple[float, float]]:
    """(step seconds, grammar seconds) of each decode step taken while all `batch` requests
    were running."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt_ids, params)
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.output_token_ids for r in engine.scheduler.running)
        whole = decoding and len(engine.scheduler.running) == batch
        clock.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        if whole:
            times.append((time.perf_counter() - start, clock.seconds))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    llm = LLM(args.model)
    prompt_ids = llm.tokenizer.apply_chat_template(PROMPT)
    grammar = grammar_of("json", SCHEMA)
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, grammar=grammar)
    clock = GrammarClock(llm)
    print(f"{args.model}, {platform.processor() or platform.machine()}, {args.rounds} rounds")
    for batch in map(int, args.batches.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "grammar": []}
        decode_steps(llm, prompt_ids, batch, constrained, clock)  # warm-up: compile, tables
        for round_index in range(args.rounds):
            order = ["plain", "grammar"] if round_index % 2 == 0 else ["grammar", "plain"]
            for name in order:
                params = plain if name == "plain" else constrained
                runs[name] += decode_steps(llm, prompt_ids, batch, params, clock)
        tpot = {name: statistics.median(s for s, _ in steps) * 1e3 for name, steps in runs.items()}
        share = statistics.median(g / s for s, g in runs["grammar"]) * 100
        grammar_ms = statistics.median(g for _, g in runs["grammar"]) * 1e3
        counts = {name: len(steps) for name, steps in runs.items()}
        print(
            f"batch {batch:2d}: TPOT plain {tpot['plain']:.2f} ms, JSON schema "
            f"{tpot['grammar']:.2f} ms; grammar work {grammar_ms:.3f} ms a step, {share:.2f}% "
            f"of its step; steps timed {counts}"
        )


if __name__ == "__main__":
    main()
