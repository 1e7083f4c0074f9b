"""Engine throughput: pdserve against Hugging Face transformers `generate` in one process, same
model, threads and prompts, beside this machine's fp32 GEMM and read speed (BENCHMARKS.md,
"Engine"): prefill tok/s of one long prompt; decode-only tok/s (after the last request's first
token) and end-to-end tok/s at each batch size; medians over repeats.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_limits(repeats: int) -> dict:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm_gflops = 2 * 2048**3 / timed(lambda: a @ b, repeats * 3) / 1e9
    big = torch.ones(256 * 2**20)  # 1 GiB, touched once so page faults are not measured
    read_gbs = big.numel() * 4 / timed(lambda: big.sum(), repeats * 3) / 1e9
    return {"gemm_gflops": gemm_gflops, "read_gbs": read_gbs}


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids above the first 1k skip special and byte tokens; any ids do for throughput.
    return torch.randint(1000, vocab, (n, length), generator=g).tolist()


def run_pdserve(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first: dict[str, float] = {}
    tokens_after_first = 0
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    all_first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if all_first is not None:
                tokens_after_first += 1
        if all_first is None and len(first) == len(prompts):
            all_first = now
    end = time.perf_counter()
    return {
        "decode_tok_s": tokens_after_first / (end - all_first) if end > all_first else 0.0,
        "e2e_tok_s": len(prompts) * new_tokens / (end - start),
    }


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([Stamp()]),
            pad_token_id=0,
        )
    end = time.perf_counter()
    # Every sequence gets its first token at the first stamp (after the batched prefill).
    return {
        "decode_tok_s": len(prompts) * (new_tokens - 1) / (end - stamps[0]),
        "e2e_tok_s": len(prompts) * new_tokens / (end - start),
    }


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=1024)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    # No prefix caching: repeats of one prompt must be computed again, as transformers does.
    llm = LLM(args.model, kv_cache_bytes=2 * 2**30, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    limits = machine_limits(args.repeats)
    # Per token: 2 FLOPs per weight (the tied embedding counts once, as the LM head).
    compute_bound = limits["gemm_gflops"] * 1e9 / (2 * sum(p.numel() for p in hf.parameters()))
    isa = getattr(llm.engine.runner.kernels, "isa", None)
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{isa} kernels: fp32 GEMM {limits['gemm_gflops']:.1f} GFLOP/s, "
        f"read {limits['read_gbs']:.1f} GB/s; medians of {args.repeats}"
    )
    prompt = make_prompts(vocab, 1, args.prefill_len, seed=1)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ours = args.prefill_len / timed(lambda: llm.generate(prompt, one), args.repeats)
    with torch.inference_mode():
        theirs = args.prefill_len / timed(lambda: hf(torch.tensor(prompt)), args.repeats)
    print(
        f"prefill, one {args.prefill_len}-token prompt: {ours:.1f} against {theirs:.1f} tok/s "
        f"({ours / theirs:.2f}x; {ours / compute_bound:.0%} of the GEMM bound)"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = make_prompts(vocab, batch, args.prompt_len, seed=batch)
        ours = median_of([run_pdserve(llm, prompts, args.new_tokens) for _ in range(args.repeats)])
        theirs = median_of([run_hf(hf, prompts, args.new_tokens) for _ in range(args.repeats)])
        for key in ours:
            print(
                f"{key} @ {batch}: pdserve {ours[key]:.1f}, transformers {theirs[key]:.1f} "
                f"({ours[key] / theirs[key]:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
