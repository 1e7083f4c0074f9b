"""A bf16 prefill role feeding an fp32 decode role, against fp32 throughout: speed and quality.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bf16_prefill.py [--num-prompts 50]

- Prefill speed: one 512-token prompt (prefix caching off), fp32 and bf16 engines
  interleaved, median over --repeats, at --threads threads.
- Greedy agreement: --num-prompts chat prompts (bench_kv_quality's), --new-tokens each, EOS
  ignored, run by a bf16 prefill engine handing its KV (converted to fp32 on the prefill side,
  `WireSource`) to an fp32 decode engine over the tcp backend, as a 1P1D cluster does; against
  the fp32 collocated engine: the share of identical first tokens, of identical positions,
  and of identical outputs. The all-bf16 engine is shown for comparison.
- Perplexity of the held-out text (bench_kv_quality's), teacher-forced in 64-token chunks:
  what a bf16 prefill computes over a prompt, against fp32.

Where the CPU has no AMX or AVX512_BF16, bf16 runs through conversions and is slower than
fp32: the script says so and measures anyway.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pdserve import envs

envs.set_worker_thread_wait()  # as a worker does: before torch loads libgomp

import torch  # noqa: E402
from bench_kv_quality import HELD_OUT, TOPICS, agreement, perplexity  # noqa: E402

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.roles.base import KVDestination  # noqa: E402
from pdserve.llm import LLM  # noqa: E402
from pdserve.model.cpu_flags import has_fast_bf16  # noqa: E402
from pdserve.model.registry import resolve_model  # noqa: E402
from pdserve.request import FinishReason  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.transfer import make_receiver, make_sender  # noqa: E402
from pdserve.transfer.layout import KVLayout  # noqa: E402

MODEL = "smollm2-135m"
SECRET = b"bench-bf16" * 4
KV_BYTES = 512 << 20


def engine_config(dtype: str, threads: int) -> EngineConfig:
    return EngineConfig(
        model=MODEL,
        cache=CacheConfig(kv_cache_bytes=KV_BYTES, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192),
        device=DeviceConfig(dtype=dtype, threads=threads),
    )


def prefill_ms(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return (time.perf_counter() - t) * 1e3


def disaggregated(prompts: list[list[int]], params: SamplingParams, threads: int) -> list:
    """Greedy outputs of a bf16 prefill engine + an fp32 decode engine joined by tcp."""
    model_dir = resolve_model(MODEL)
    d = Engine(engine_config("float32", threads), model_dir, "decode")
    rx = make_receiver("tcp", d.runner.kv_cache, KVLayout.from_tensor(d.runner.kv_cache), SECRET)
    d.switch_role(d.decode_role(rx))
    p = Engine(engine_config("bfloat16", threads), model_dir, "prefill")
    wire = p.wire_source("auto", "float32")
    tx = make_sender("tcp", wire.kv, KVLayout.from_tensor(wire.kv), SECRET)
    p.switch_role(p.prefill_role(tx, "layerwise", wire))
    out: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            r = d.reserve(rid, prompt, params)
            p.add_prefill(rid, prompt, params, KVDestination(rx.address(), r.block_ids))
            out[rid] = []
        pending = set(out)
        while pending:
            assert p.role.poll() == [] and d.role.poll() == []
            for o in p.step() if p.has_unfinished_requests() else []:
                out[o.request_id] += o.new_token_ids
                assert o.finish_reason is FinishReason.HANDOFF
                d.role.start(o.request_id, o.new_token_ids[0])
            for o in d.step() if d.has_unfinished_requests() else []:
                out[o.request_id] += o.new_token_ids
                if o.finished:
                    pending.discard(o.request_id)
            time.sleep(0 if d.has_unfinished_requests() else 0.001)
    finally:
        tx.close()
        rx.close()
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not has_fast_bf16():
        print("note: this CPU has neither AMX nor AVX512_BF16: bf16 is emulated here")
    llms = {dt: LLM(MODEL, dtype=dt, threads=args.threads, kv_cache_bytes=KV_BYTES,
                    enable_prefix_caching=False) for dt in ("float32", "bfloat16")}  # fmt: skip
    prompt = torch.randint(1000, 40000, (512,), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {dt: [] for dt in llms}
    for i in range(args.repeats + 1):
        for dt, llm in llms.items():
            ms = prefill_ms(llm, prompt.tolist())
            if i:  # the first call of each warms up
                times[dt].append(ms)
    results = {"prefill_ms_512": {dt: statistics.median(t) for dt, t in times.items()}}
    tok = llms["float32"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Explain {t} in detail."}])
               for t in TOPICS[: args.num_prompts]]  # fmt: skip
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in llms["float32"].generate(prompts, params)]
    runs = {
        "bf16 prefill -> fp32 decode": disaggregated(prompts, params, args.threads),
        "bf16 throughout": [o.token_ids for o in llms["bfloat16"].generate(prompts, params)],
    }
    ids = tok.encode(HELD_OUT.read_text())[:2048]
    ppl = {dt: perplexity(llm, "auto", ids) for dt, llm in llms.items()}
    results["perplexity"] = ppl
    print(f"512-token prefill, {args.threads} threads, median of {args.repeats}: "
          f"fp32 {results['prefill_ms_512']['float32']:.0f} ms, "
          f"bf16 {results['prefill_ms_512']['bfloat16']:.0f} ms")  # fmt: skip
    print(f"perplexity (2,048 held-out tokens): fp32 {ppl['float32']:.3f}, bf16 "
          f"{ppl['bfloat16']:.3f} ({ppl['bfloat16'] / ppl['float32'] - 1:+.2%})")  # fmt: skip
    print("\n| against fp32 | first token | positions | identical outputs |")
    print("|---|---|---|---|")
    for name, outs in runs.items():
        first = sum(a[0] == b[0] for a, b in zip(ref, outs)) / len(ref)
        pos = statistics.mean(agreement(a, b) for a, b in zip(ref, outs))
        same = sum(a == b for a, b in zip(ref, outs))
        results[name] = {"first_token": first, "positions": pos, "identical": same}
        print(f"| {name} | {first:.1%} | {pos:.1%} | {same}/{len(ref)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
