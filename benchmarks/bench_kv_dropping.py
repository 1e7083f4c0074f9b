"""Quality and size of KV token dropping at several budgets, on the real default model.

    .venv/bin/python benchmarks/bench_kv_dropping.py [--budgets 96 128 160] [--num-prompts 50]

- Greedy agreement: the bench_kv_quality prompts, 128 new tokens each (EOS ignored), with a
  budget vs without; share of positions with the same token, and identical outputs.
- Perplexity: the held-out text is fed token by token through the engine (teacher forcing:
  the sampler is replaced, in this script only, by one that records the log-probability of the
  true next token and returns it), so every token is predicted from the dropped cache exactly
  as in decode. The first 64 tokens are the prompt; the next --score-tokens are scored.
- KV held per sequence (bytes) at the end, against the full sequence.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from bench_kv_quality import HELD_OUT, TOPICS, agreement

import pdserve.engine.model_runner as model_runner
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

BYTES_PER_TOKEN = 46080


def perplexity(llm: LLM, ids: list[int], budget: int | None, prompt_len: int, n: int) -> float:
    forced = ids[prompt_len : prompt_len + n]
    nll: list[float] = []
    real_sample = model_runner.sample

    def teacher(logits, rows, generator):
        i = rows[0].output_index
        nll.append(-torch.log_softmax(logits[0], -1)[forced[i]].item())
        return [forced[i]]

    model_runner.sample = teacher
    try:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                kv_budget_tokens=budget)  # fmt: skip
        llm.generate([ids[:prompt_len]], params)
    finally:
        model_runner.sample = real_sample
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[96, 128, 160])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--score-tokens", type=int, default=384)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM("smollm2-135m", kv_cache_bytes=512 << 20, kv_sink_tokens=16, kv_recent_tokens=32)
    chat = llm.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": f"Explain {t} in detail."}])
               for t in TOPICS[: args.num_prompts]]  # fmt: skip
    held_out = llm.tokenizer.encode(HELD_OUT.read_text())
    rows = []
    reference = None
    for budget in [None, *args.budgets]:
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                                kv_budget_tokens=budget)  # fmt: skip
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        reference = reference or outs
        seq_len = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens
        held = min(seq_len, budget) if budget else seq_len
        row = {
            "budget": budget or "none",
            "agreement": sum(agreement(a, b) for a, b in zip(reference, outs)) / len(outs),
            "identical": f"{sum(a == b for a, b in zip(reference, outs))}/{len(outs)}",
            "perplexity": perplexity(llm, held_out, budget, 64, args.score_tokens),
            "kv_bytes_held": held * BYTES_PER_TOKEN,
            "kv_share": held / seq_len,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\n| KV budget (tokens) | KV held per sequence | greedy agreement | identical outputs "
        "| perplexity |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['budget']} | {r['kv_bytes_held'] / 1e6:.1f} MB ({r['kv_share']:.0%}) "
            f"| {r['agreement']:.1%} | {r['identical']} | {r['perplexity']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
