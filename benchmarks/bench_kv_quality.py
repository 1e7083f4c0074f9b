"""KV quality on the real default model: 8-bit KV (fp8, int8), or token dropping at budgets,
against full-precision KV.

    .venv/bin/python benchmarks/bench_kv_quality.py [--num-prompts 50] [--kv-dtypes fp8 int8]
    .venv/bin/python benchmarks/bench_kv_quality.py --drop-budgets 96 128 160

- Greedy agreement: chat prompts, `--new-tokens` each (EOS ignored): the share of positions
  with the same token as with full KV, and of identical outputs.
- Perplexity of a held-out text (Debian's GPL-3 text). 8-bit KV: scored in 64-token chunks
  that read earlier chunks through the quantized cache. Dropping: the first 64 tokens are the
  prompt, the next `--score-tokens` are fed one by one (teacher forcing: the sampler is
  replaced, here only, by one that records the true token's log-probability), so every token
  is predicted from the dropped cache as in decode.
- KV bytes per token (8-bit), or KV held per sequence (dropping); transfer time follows the
  bytes (benchmarks/transfer_ttft.py).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import pdserve.engine.model_runner as model_runner
from pdserve.llm import LLM
from pdserve.model.attention import AttentionMetadata, PrefillSpan
from pdserve.model.kv_cache import QUANTIZED, layer_caches, row_size, storage_dtype
from pdserve.sampling_params import SamplingParams

TOPICS = (
    "photosynthesis;the French revolution;black holes;machine learning;volcanoes;"
    "the immune system;blockchains;climate change;the printing press;DNA;supply and demand;"
    "the Roman empire;quantum computing;jazz music;vaccines;plate tectonics;the internet;"
    "bees;nuclear fusion;the stock market;renewable energy;the moon landing;"
    "compound interest;coral reefs;antibiotics;the water cycle;electric cars;"
    "the Renaissance;earthquakes;neural networks;the solar system;inflation;"
    "the human brain;recycling;the Great Wall of China;gravity;democracy;rainforests;"
    "3D printing;the Olympic games;the theory of evolution;cryptography;tides;sleep;"
    "the Silk Road;batteries;honey;glaciers;chess;the speed of light"
).split(";")
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
ROW_NAMES = {"fp8": "E4M3", "int8": "int8"}


def chat_prompts(llm: LLM, num_prompts: int) -> list[list[int]]:
    chat = llm.tokenizer.apply_chat_template
    return [chat([{"role": "user", "content": f"Explain {t} in detail."}])
            for t in TOPICS[:num_prompts]]  # fmt: skip


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def perplexity(llm: LLM, kv_cache_dtype: str, ids: list[int], chunk: int = 64) -> float:
    """Teacher-forced perplexity, chunk by chunk through a paged cache of the given dtype."""
    runner, cfg = llm.engine.runner, llm.engine.model_config
    bs = 16
    num_blocks = -(-len(ids) // bs)
    shape = (
        cfg.num_layers,
        num_blocks,
        2,
        cfg.num_kv_heads,
        bs,
        row_size(cfg.head_dim, kv_cache_dtype),
    )
    kv = torch.zeros(shape, dtype=storage_dtype(kv_cache_dtype, runner.dtype))
    caches = layer_caches(kv, kv_cache_dtype)
    table = torch.arange(num_blocks)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids) - 1)
            pos = torch.arange(start, end)
            # From the second chunk on, attention reads every key, its own too, from the cache.
            span = PrefillSpan(0, end - start, start, table)
            meta = AttentionMetadata(pos // bs, pos % bs, prefills=[span])
            hidden = runner.model(torch.tensor(ids[start:end]), pos, caches, meta)
            logp = runner.model.compute_logits(hidden).log_softmax(-1)
            target = torch.tensor(ids[start + 1 : end + 1])
            nll -= logp[torch.arange(end - start), target].sum().item()
            count += end - start
    return math.exp(nll / count)


def forced_perplexity(llm: LLM, ids: list[int], budget: int | None, n: int) -> float:
    """Perplexity of `ids[64:64 + n]` after a 64-token prompt, token by token under `budget`."""
    forced, nll, real_sample = ids[64 : 64 + n], [], model_runner.sample

    def teacher(logits, rows, *_):
        i = rows[0].output_index
        nll.append(-torch.log_softmax(logits[0], -1)[forced[i]].item())
        return [forced[i]]

    model_runner.sample = teacher
    try:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                kv_budget_tokens=budget)  # fmt: skip
        llm.generate([ids[:64]], params)
    finally:
        model_runner.sample = real_sample
    return math.exp(sum(nll) / len(nll))


def dropping(args: argparse.Namespace) -> list[dict]:
    llm = LLM("smollm2-135m", kv_cache_bytes=512 << 20, kv_sink_tokens=16, kv_recent_tokens=32)
    prompts = chat_prompts(llm, args.num_prompts)
    held_out = llm.tokenizer.encode(HELD_OUT.read_text())
    seq_len = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens
    rows, reference = [], None
    print("| KV budget | KV held per sequence | greedy agreement | identical | perplexity |")
    print("|---|---|---|---|---|")
    for budget in [None, *args.drop_budgets]:
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                                kv_budget_tokens=budget)  # fmt: skip
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        reference = reference or outs
        held = min(seq_len, budget) if budget else seq_len
        ppl = forced_perplexity(llm, held_out, budget, args.score_tokens)
        same = sum(a == b for a, b in zip(reference, outs))
        row = {"budget": budget or "none", "kv_bytes_held": held * 46080,
               "kv_share": held / seq_len, "perplexity": ppl, "identical": f"{same}/{len(outs)}",
               "agreement": sum(map(agreement, reference, outs)) / len(outs)}  # fmt: skip
        rows.append(row)
        print(f"| {row['budget']} | {held * 46080 / 1e6:.1f} MB ({row['kv_share']:.0%}) "
              f"| {row['agreement']:.1%} | {row['identical']} | {row['perplexity']:.3f} |",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-dtypes", nargs="+", default=list(QUANTIZED), choices=list(QUANTIZED))
    ap.add_argument("--drop-budgets", type=int, nargs="*", default=[],
                    help="token dropping at these KV budgets instead of 8-bit KV")  # fmt: skip
    ap.add_argument("--score-tokens", type=int, default=384)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.drop_budgets:
        rows = dropping(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    results: dict = {}
    outputs: dict[str, list[list[int]]] = {}
    for dtype in ("auto", *args.kv_dtypes):
        llm = LLM("smollm2-135m", kv_cache_dtype=dtype, kv_cache_bytes=512 << 20)
        prompts = chat_prompts(llm, args.num_prompts)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        outputs[dtype] = [o.token_ids for o in llm.generate(prompts, params)]
        ids = llm.tokenizer.encode(HELD_OUT.read_text())[:2048]
        row_bytes = storage_dtype(dtype, torch.float32).itemsize
        results[dtype] = {
            "perplexity": perplexity(llm, dtype, ids),
            "kv_bytes_per_token": 30 * 2 * 3 * row_size(64, dtype) * row_bytes,
        }
        print(dtype, json.dumps(results[dtype]), flush=True)
    for dtype in args.kv_dtypes:
        agree = [agreement(a, b) for a, b in zip(outputs["auto"], outputs[dtype])]
        exact = sum(a == b for a, b in zip(outputs["auto"], outputs[dtype]))
        results[dtype]["greedy_agreement"] = sum(agree) / len(agree)
        results[dtype]["identical_outputs"] = f"{exact}/{len(agree)}"
    a = results["auto"]
    print("\n| KV dtype | bytes/token | perplexity | greedy agreement | identical outputs |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {a['kv_bytes_per_token']} | {a['perplexity']:.3f} | 100% | - |")
    for dtype in args.kv_dtypes:
        f = results[dtype]
        print(
            f"| {dtype} ({ROW_NAMES[dtype]} + per-token scale) | {f['kv_bytes_per_token']} "
            f"({f['kv_bytes_per_token'] / a['kv_bytes_per_token']:.1%}) "
            f"| {f['perplexity']:.3f} ({f['perplexity'] / a['perplexity'] - 1:+.2%}) "
            f"| {f['greedy_agreement']:.1%} | {f['identical_outputs']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
