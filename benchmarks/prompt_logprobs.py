"""What scoring a prompt costs (completions' `echo` with `logprobs`): the prefill of one
request with and without SamplingParams.prompt_logprobs, on the real model.

Each round prefills a fresh random prompt (no prefix-cache hit either way) once plain and
once with 5 alternatives per prompt token, in alternating order (the machine drifts;
alternation makes the ratio fair); `max_tokens` 1, so the step is the prefill and the first
token. The median per-round time of each and the median ratio are printed, and first the
scoring alone (`prompt_logprobs()`: the LM head, log-softmax and top 5 over every position,
in 256-position slices) on random hidden states, the median of 10 runs.

    .venv/bin/python benchmarks/prompt_logprobs.py [--model smollm2-135m] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def prefill_ms(llm: LLM, prompt: list[int], params: SamplingParams, tag: str) -> float:
    engine = llm.engine
    request = engine.add_request(tag, prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    want = params.prompt_logprobs is not None
    assert request.is_finished and (request.num_cached_tokens == 0 or not want)
    return elapsed


def scoring_ms(llm: LLM, num_positions: int) -> float:
    import torch

    from pdserve.model.logprobs import prompt_logprobs

    model = llm.engine.runner.model
    hidden = torch.randn(num_positions, model.config.hidden_size)
    ids = [i % model.config.vocab_size for i in range(num_positions)]
    times = []
    with torch.inference_mode():
        for _ in range(11):
            start = time.perf_counter()
            prompt_logprobs(model.compute_logits, hidden, ids, 5)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    llm = LLM(args.model)
    print(f"scoring {args.prompt_len} positions alone: {scoring_ms(llm, args.prompt_len):.1f} ms")
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    settings = {
        "plain": SamplingParams(max_tokens=1, temperature=0.0),
        "prompt_logprobs": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5),
    }
    results: dict[str, list[float]] = {name: [] for name in settings}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        order = list(settings) if round_index % 2 == 0 else list(reversed(settings))
        for name in order:
            prompt = [rng.randrange(200, vocab) for _ in range(args.prompt_len)]
            ms = prefill_ms(llm, prompt, settings[name], f"{name}-{round_index}")
            if round_index:
                results[name].append(ms)
                print(f"round {round_index} {name}: {ms:.1f} ms", flush=True)
    plain, scored = results["plain"], results["prompt_logprobs"]
    ratio = statistics.median(s / p for s, p in zip(scored, plain))
    print(f"prompt {args.prompt_len} tokens, {args.rounds} rounds: plain "
          f"{statistics.median(plain):.1f} ms, prompt_logprobs=5 {statistics.median(scored):.1f} "
          f"ms, x{ratio:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
