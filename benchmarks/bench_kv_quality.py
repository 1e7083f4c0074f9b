"""Quality and size of 8-bit KV (fp8, int8) against full-precision KV, on the real default
model.

    .venv/bin/python benchmarks/bench_kv_quality.py [--num-prompts 50] [--new-tokens 128]
        [--kv-dtypes fp8 int8]

- Greedy agreement: 50 chat prompts, 128 new tokens each (EOS ignored), with fp32 KV and with
  each 8-bit KV; the share of positions where the 8-bit run produced the same token (up to the
  first divergence counts as agreement; after it, tokens are compared position by position).
- Perplexity of a held-out text (the GPL-3 licence text shipped with Debian, unseen by this
  comparison), scored in chunks of 64 tokens so every chunk attends to earlier chunks through
  the cache — the quantized cache is what the model reads, as it would during decode.
- KV bytes per token and the time to move one 2,048-token prompt's KV over tcp and shm.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from pdserve.llm import LLM
from pdserve.model.attention import AttentionMetadata, PrefillSpan
from pdserve.model.kv_cache import QUANTIZED, layer_caches, row_size, storage_dtype
from pdserve.sampling_params import SamplingParams

TOPICS = [
    "photosynthesis",
    "the French revolution",
    "black holes",
    "machine learning",
    "volcanoes",
    "the immune system",
    "blockchains",
    "climate change",
    "the printing press",
    "DNA",
    "supply and demand",
    "the Roman empire",
    "quantum computing",
    "jazz music",
    "vaccines",
    "plate tectonics",
    "the internet",
    "bees",
    "nuclear fusion",
    "the stock market",
    "renewable energy",
    "the moon landing",
    "compound interest",
    "coral reefs",
    "antibiotics",
    "the water cycle",
    "electric cars",
    "the Renaissance",
    "earthquakes",
    "neural networks",
    "the solar system",
    "inflation",
    "the human brain",
    "recycling",
    "the Great Wall of China",
    "gravity",
    "democracy",
    "rainforests",
    "3D printing",
    "the Olympic games",
    "the theory of evolution",
    "cryptography",
    "tides",
    "sleep",
    "the Silk Road",
    "batteries",
    "honey",
    "glaciers",
    "chess",
    "the speed of light",
]
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
ROW_NAMES = {"fp8": "E4M3", "int8": "int8"}


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


def transfer_ms(kv_cache_dtype: str, backend: str, num_tokens: int = 2048) -> float:
    from pdserve.transfer import make_receiver, make_sender
    from pdserve.transfer.layout import KVLayout
    from pdserve.transfer.shm import create_shared_kv

    dtype = storage_dtype(kv_cache_dtype, torch.float32)
    layout = KVLayout(30, -(-num_tokens // 16), 16, 3, row_size(64, kv_cache_dtype),
                      str(dtype).removeprefix("torch."))  # fmt: skip
    rx_kv = (
        create_shared_kv(layout)[0] if backend == "shm" else torch.zeros(layout.shape, dtype=dtype)
    )
    tx_kv = torch.zeros_like(rx_kv)
    rx = make_receiver(backend, rx_kv, layout, b"q" * 32)
    tx = make_sender(backend, tx_kv, layout, b"q" * 32)
    blocks = list(range(layout.num_blocks))
    times = []
    try:
        for i in range(4):
            rid = f"r{i}"
            rx.expect(rid, blocks)
            t = time.perf_counter()
            tx.send(rx.address(), rid, list(range(30)), blocks, blocks, True)
            while not any(r == rid for r, _, _ in rx.pop_finished()):
                time.sleep(0.0002)
            times.append(time.perf_counter() - t)
            rx.release(rid)
    finally:
        tx.close()
        rx.close()
    return sorted(times[1:])[1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-dtypes", nargs="+", default=list(QUANTIZED), choices=list(QUANTIZED))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict = {}
    outputs: dict[str, list[list[int]]] = {}
    ref_llm = None
    for dtype in ("auto", *args.kv_dtypes):
        llm = LLM("smollm2-135m", kv_cache_dtype=dtype, kv_cache_bytes=512 << 20)
        ref_llm = ref_llm or llm
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Explain {t} in detail."}]
            )
            for t in TOPICS[: args.num_prompts]
        ]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outputs[dtype] = [o.token_ids for o in llm.generate(prompts, params)]
        elapsed = time.perf_counter() - t
        ids = llm.tokenizer.encode(HELD_OUT.read_text())[:2048]
        row_bytes = storage_dtype(dtype, torch.float32).itemsize
        results[dtype] = {
            "perplexity": perplexity(llm, dtype, ids),
            "kv_bytes_per_token": 30 * 2 * 3 * row_size(64, dtype) * row_bytes,
            "generate_s": elapsed,
            "transfer_ms_2048_tcp": transfer_ms(dtype, "tcp"),
            "transfer_ms_2048_shm": transfer_ms(dtype, "shm"),
        }
        print(dtype, json.dumps(results[dtype]), flush=True)
    for dtype in args.kv_dtypes:
        agree = [agreement(a, b) for a, b in zip(outputs["auto"], outputs[dtype])]
        exact = sum(a == b for a, b in zip(outputs["auto"], outputs[dtype]))
        results[dtype]["greedy_agreement"] = sum(agree) / len(agree)
        results[dtype]["identical_outputs"] = f"{exact}/{len(agree)}"
    a = results["auto"]
    print(
        "\n| KV dtype | bytes/token | perplexity | greedy agreement | identical outputs "
        "| 2,048-token KV over tcp | over shm |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| fp32 | {a['kv_bytes_per_token']} | {a['perplexity']:.3f} | 100% | - "
        f"| {a['transfer_ms_2048_tcp']:.0f} ms | {a['transfer_ms_2048_shm']:.0f} ms |"
    )
    for dtype in args.kv_dtypes:
        f = results[dtype]
        print(
            f"| {dtype} ({ROW_NAMES[dtype]} + per-token scale) | {f['kv_bytes_per_token']} "
            f"({f['kv_bytes_per_token'] / a['kv_bytes_per_token']:.1%}) "
            f"| {f['perplexity']:.3f} ({f['perplexity'] / a['perplexity'] - 1:+.2%}) "
            f"| {f['greedy_agreement']:.1%} | {f['identical_outputs']} "
            f"| {f['transfer_ms_2048_tcp']:.0f} ms | {f['transfer_ms_2048_shm']:.0f} ms |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
