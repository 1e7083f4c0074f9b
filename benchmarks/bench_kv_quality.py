"""KV quality on the real default model against full-precision KV (BENCHMARKS.md, "KV
compression and token dropping"): 8-bit KV (fp8, int8), or with `--drop-budgets` token dropping.
Per setting, one JSON line: greedy agreement on chat prompts, the perplexity of a held-out text
(through the quantized or dropped cache), and the KV bytes per token or held per sequence.
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
KV_TOKEN_BYTES = 46080  # SmolLM2-135M, fp32 K+V


def chat_prompts(llm: LLM, num_prompts: int) -> list[list[int]]:
    chat = llm.tokenizer.apply_chat_template
    return [
        chat([{"role": "user", "content": f"Explain {t} in detail."}]) for t in TOPICS[:num_prompts]
    ]


def greedy(llm: LLM, args: argparse.Namespace, budget: int | None = None) -> list[list[int]]:
    params = SamplingParams(
        max_tokens=args.new_tokens, temperature=0, ignore_eos=True, kv_budget_tokens=budget
    )
    return [o.token_ids for o in llm.generate(chat_prompts(llm, args.num_prompts), params)]


def agreement(reference: list[list[int]], outs: list[list[int]]) -> dict[str, object]:
    """The share of positions with the reference's token, and the outputs equal to it."""
    shares = [sum(x == y for x, y in zip(a, b)) / max(len(a), 1) for a, b in zip(reference, outs)]
    same = sum(a == b for a, b in zip(reference, outs))
    return {"greedy_agreement": sum(shares) / len(shares), "identical": f"{same}/{len(outs)}"}


def perplexity(llm: LLM, kv_cache_dtype: str, ids: list[int], chunk: int = 64) -> float:
    """Teacher-forced perplexity, chunk by chunk through a paged cache of the given dtype."""
    runner, cfg = llm.engine.runner, llm.engine.model_config
    bs = 16
    num_blocks = -(-len(ids) // bs)
    shape = (cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, bs)
    kv = torch.zeros(
        *shape,
        row_size(cfg.head_dim, kv_cache_dtype),
        dtype=storage_dtype(kv_cache_dtype, runner.dtype),
    )
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
        params = SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True, kv_budget_tokens=budget
        )
        llm.generate([ids[:64]], params)
    finally:
        model_runner.sample = real_sample
    return math.exp(sum(nll) / len(nll))


def dropping(args: argparse.Namespace) -> list[dict]:
    llm = LLM("smollm2-135m", kv_cache_bytes=512 << 20, kv_sink_tokens=16, kv_recent_tokens=32)
    held_out = llm.tokenizer.encode(HELD_OUT.read_text())
    prompts = chat_prompts(llm, args.num_prompts)
    seq_len = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens
    rows, reference = [], None
    for budget in [None, *args.drop_budgets]:
        outs = greedy(llm, args, budget)
        reference = reference or outs
        held = min(seq_len, budget) if budget else seq_len
        row = {"budget": budget, "kv_bytes_held": held * KV_TOKEN_BYTES, "kv_share": held / seq_len}
        row["perplexity"] = forced_perplexity(llm, held_out, budget, args.score_tokens)
        rows.append(row | agreement(reference, outs))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def eight_bit(args: argparse.Namespace) -> list[dict]:
    rows, reference = [], None
    for dtype in ("auto", *args.kv_dtypes):
        llm = LLM("smollm2-135m", kv_cache_dtype=dtype, kv_cache_bytes=512 << 20)
        outs = greedy(llm, args)
        reference = reference or outs
        ids = llm.tokenizer.encode(HELD_OUT.read_text())[:2048]
        row_bytes = row_size(64, dtype) * storage_dtype(dtype, torch.float32).itemsize
        row = {"kv_dtype": dtype, "kv_bytes_per_token": 30 * 2 * 3 * row_bytes}
        row["perplexity"] = perplexity(llm, dtype, ids)
        rows.append(row | agreement(reference, outs))
        fp32 = rows[0]
        rows[-1]["bytes_of_fp32"] = row["kv_bytes_per_token"] / fp32["kv_bytes_per_token"]
        rows[-1]["perplexity_change"] = row["perplexity"] / fp32["perplexity"] - 1
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-dtypes", nargs="+", default=list(QUANTIZED), choices=list(QUANTIZED))
    ap.add_argument("--drop-budgets", type=int, nargs="*", default=[], help="instead of 8-bit")
    ap.add_argument("--score-tokens", type=int, default=384)
    args = ap.parse_args()
    (dropping if args.drop_budgets else eight_bit)(args)


if __name__ == "__main__":
    main()
