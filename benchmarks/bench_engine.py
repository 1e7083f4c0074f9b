"""Engine throughput: pdserve against Hugging Face transformers `generate` in one process, same
model, threads and prompts, beside this machine's own fp32 limits.

    .venv/bin/python benchmarks/bench_engine.py [--repeats 3] [--batches 1,8,32]
    PDSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_engine.py   # the AVX2 kernels

Medians over repeats: prefill tok/s of one 1,024-token prompt; at 1, 8 and 32 concurrent
requests (128 prompt tokens, exactly 128 new), decode-only tok/s (after the last request's
first token) and end-to-end tok/s; the machine's GEMM GFLOP/s and read GB/s as the model's
compute bound and batch-1 memory bound (for the bytes pdserve's linears hold).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pdserve.config import CPU_KERNELS
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of linear weights one decode step reads: each linear's panel copy where it has
    one (compact or fp32), else its oneDNN or plain fp32 weight."""
    total = 0
    for m in model.modules():
        panels = getattr(m, "panel_weight", None)
        if panels is not None:
            total += panels.nbytes
        elif getattr(m, "packed_weight", None) is not None:
            total += m.in_features * m.out_features * 4
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


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
    dst = torch.empty_like(big)
    copy_gbs = 2 * big.numel() * 4 / timed(lambda: dst.copy_(big), repeats * 3) / 1e9
    return {"gemm_gflops": gemm_gflops, "read_gbs": read_gbs, "copy_gbs": copy_gbs}


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--cpu-kernels", default="native", choices=CPU_KERNELS)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    # No prefix caching: repeats of one prompt must be computed again, as transformers does.
    llm = LLM(
        args.model,
        kv_cache_bytes=2 * 2**30,
        enable_prefix_caching=False,
        cpu_kernels=args.cpu_kernels,
    )
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    cfg = llm.engine.model_config
    num_params = sum(p.numel() for p in hf.parameters())
    limits = machine_limits(args.repeats)
    # Per token: 2 FLOPs per weight (the tied embedding counts once, as the LM head).
    compute_bound = limits["gemm_gflops"] * 1e9 / (2 * num_params)
    # Batch-1 decode streams the weights once per token: fp32 for transformers; for pdserve
    # what its linears hold (compact lossless panels for GGUF weights, panel_codec.py).
    ours_bytes = streamed_weight_bytes(llm.engine.runner.model)
    memory_bound = limits["read_gbs"] * 1e9 / ours_bytes
    fp32_memory_bound = limits["read_gbs"] * 1e9 / (num_params * 4)

    prefill_prompt = make_prompts(cfg.vocab_size, 1, args.prefill_len, seed=1)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ours_prefill = args.prefill_len / timed(lambda: llm.generate(prefill_prompt, one), args.repeats)
    with torch.inference_mode():
        hf_prefill = args.prefill_len / timed(
            lambda: hf(torch.tensor(prefill_prompt)), args.repeats
        )
    results = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cpu_kernels": args.cpu_kernels,
            "cpu_isa": getattr(llm.engine.runner.kernels, "isa", None),
            **limits,
        },
        "model": {"name": args.model, "params": num_params, "pdserve_weight_bytes": ours_bytes},
        "bounds": {
            "compute_tok_s": compute_bound,
            "memory_bs1_tok_s": memory_bound,
            "fp32_memory_bs1_tok_s": fp32_memory_bound,
        },
        "prefill_tok_s": {"pdserve": ours_prefill, "transformers": hf_prefill},
        "batches": {},
    }
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = make_prompts(cfg.vocab_size, batch, args.prompt_len, seed=batch)
        ours = median_of([run_pdserve(llm, prompts, args.new_tokens) for _ in range(args.repeats)])
        theirs = median_of([run_hf(hf, prompts, args.new_tokens) for _ in range(args.repeats)])
        results["batches"][batch] = {"pdserve": ours, "transformers": theirs}
        print(f"batch {batch}: pdserve {ours}  transformers {theirs}", flush=True)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def print_table(r: dict) -> None:
    m, b = r["machine"], r["bounds"]
    print(
        f"\nmachine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, "
        f"pdserve cpu_kernels={m.get('cpu_kernels', 'onednn')} ({m.get('cpu_isa')})"
    )
    print(
        f"fp32 GEMM {m['gemm_gflops']:.1f} GFLOP/s, read {m['read_gbs']:.1f} GB/s, "
        f"copy {m['copy_gbs']:.1f} GB/s -> compute bound {b['compute_tok_s']:.0f} tok/s, "
        f"batch-1 memory bound {b['memory_bs1_tok_s']:.1f} tok/s for pdserve's "
        f"{r['model']['pdserve_weight_bytes'] / 1e6:.0f} MB of weights per step "
        f"({b['fp32_memory_bs1_tok_s']:.1f} tok/s for fp32 weights)\n"
    )
    print("| figure | pdserve | transformers | ratio | pdserve / bound |")
    print("|---|---|---|---|---|")
    p = r["prefill_tok_s"]
    row("prefill tok/s (1,024-token prompt)", p["pdserve"], p["transformers"], b["compute_tok_s"])
    for batch, x in r["batches"].items():
        bound = b["memory_bs1_tok_s"] if batch == 1 else b["compute_tok_s"]
        for key, label in (("decode_tok_s", "decode-only"), ("e2e_tok_s", "end-to-end")):
            row(f"{label} tok/s @ {batch}", x["pdserve"][key], x["transformers"][key], bound)


def row(label: str, ours: float, theirs: float, bound: float) -> None:
    print(f"| {label} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {ours / bound:.0%} |")


if __name__ == "__main__":
    main()
