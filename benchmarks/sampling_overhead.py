"""Per-token cost of penalties and of logprobs in a batch-32 decode step, on the real model.

Three settings share one engine: plain sampling, the logits processing (repetition,
presence and frequency penalties, a 16-entry logit_bias, min_tokens), and logprobs with 5
alternatives. Each round runs `--batch` requests of the same prompts per setting (prefix
cache hits make every prefill after the first cheap) and times only the decode steps, the
steps in which every request is past its prompt. Rounds alternate the settings (the
machine drifts; alternation makes the ratios fair); the median of the per-round mean step
times is reported, and each setting's overhead against plain sampling in the same rounds.

The sampling stage alone is timed first (the same three settings on [32, 49152] logits,
512-token prompts, 32 and 256 output tokens): the milliseconds each adds per step, free of
the model's own noise.

    .venv/bin/python benchmarks/sampling_overhead.py [--model smollm2-135m] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

BASE = dict(temperature=0.8, top_p=0.95, ignore_eos=True)
SETTINGS = {
    "plain": {},
    "penalties": dict(
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=tuple((t, -1.0) for t in range(100, 116)),
        min_tokens=8,
    ),
    "logprobs": dict(logprobs=5),
}


def decode_step_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str):
    engine = llm.engine
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
        start = time.perf_counter()
        engine.step()
        if decoding and not any(r.is_finished for r in requests):
            times.append(time.perf_counter() - start)
    return statistics.mean(times) * 1e3


def stage_ms(vocab: int, batch: int, prompt_len: int, output_len: int, rounds: int):
    """The sampling stage alone on [batch, vocab] logits, per setting: sample() after the
    setting's own work (apply_penalties over histories of prompt_len + output_len tokens,
    or raw_logprobs + token_logprobs with 5 alternatives). Interleaved; median ms."""
    import torch

    from pdserve.model.logprobs import raw_logprobs, token_logprobs
    from pdserve.model.penalties import PenaltyRow, apply_penalties
    from pdserve.model.sampler import SamplingRow, sample

    rng = random.Random(1)
    base = torch.randn(batch, vocab) * 4
    rows = [SamplingRow(0.8, 0, 1.0, 1, output_len) for _ in range(batch)]
    extra = SETTINGS["penalties"]
    penalty_rows = [
        PenaltyRow(
            i,
            [rng.randrange(vocab) for _ in range(prompt_len)],
            [rng.randrange(vocab) for _ in range(output_len)],
            extra["repetition_penalty"],
            extra["presence_penalty"],
            extra["frequency_penalty"],
            extra["logit_bias"],
        )
        for i in range(batch)
    ]
    generator = torch.Generator().manual_seed(0)

    def plain(logits):
        sample(logits, rows, generator)

    def penalties(logits):
        apply_penalties(logits, penalty_rows)
        sample(logits, rows, generator)

    def logprobs(logits):
        raw = raw_logprobs(logits, list(range(batch)))
        tokens = sample(logits, rows, generator)
        token_logprobs(raw, tokens, [5] * batch)

    times: dict[str, list[float]] = {"plain": [], "penalties": [], "logprobs": []}
    for _ in range(rounds):
        for name, run in (("plain", plain), ("penalties", penalties), ("logprobs", logprobs)):
            logits = base.clone()
            start = time.perf_counter()
            run(logits)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--stage-only", action="store_true", help="the sampling stage alone")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    for output_len in (32, 256):
        stage = stage_ms(49152, args.batch, 512, output_len, 40)
        added = {k: v - stage["plain"] for k, v in stage.items()}
        print(f"sampling stage, batch {args.batch}, vocab 49152, prompt 512, output {output_len}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in stage.items())
              + f"; added: penalties {added['penalties']:.2f} ms, "
              f"logprobs {added['logprobs']:.2f} ms per step")  # fmt: skip
    if args.stage_only:
        return
    llm = LLM(args.model, **({"threads": args.threads} if args.threads else {}))
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(200, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    params = {
        name: SamplingParams(max_tokens=args.max_tokens, seed=1, **BASE, **extra)
        for name, extra in SETTINGS.items()
    }
    decode_step_ms(llm, prompts, params["plain"], "warm")  # fills the prefix cache
    results: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_index in range(args.rounds):
        order = list(SETTINGS) if round_index % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            tag = f"{name}-{round_index}"
            results[name].append(decode_step_ms(llm, prompts, params[name], tag))
            print(f"round {round_index} {name}: {results[name][-1]:.2f} ms/step", flush=True)
    plain = results["plain"]
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens, "
          f"{args.rounds} rounds; median per-round mean decode step")  # fmt: skip
    for name, values in results.items():
        overhead = statistics.median((v - p) / p * 100 for v, p in zip(values, plain))
        print(f"{name:>10}: {statistics.median(values):7.2f} ms/step  {overhead:+5.1f}% vs plain")


if __name__ == "__main__":
    main()
