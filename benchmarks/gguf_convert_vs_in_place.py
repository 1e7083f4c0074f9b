"""One GGUF both ways the loading rule can take it (model/gguf_convert.py): converted to fp32
(`gguf_fp32_max_bytes` past its size: compact panels, fp32 activations) and read in place (0:
the mapped file, int8 activations), batch-1 decode ms/token in one process, interleaved rounds.

A round times `generate` of 1 and of 1 + `--tokens` tokens on each model; the difference over
`--tokens` is the decode step. With `--threads 1` the kernels run on the calling thread, so its
CPU time (printed beside the wall time) leaves out the time other processes' load takes.

    pdserve synth --shape llama-1b --type q8_0 --output /tmp/llama-1b.q8_0.gguf
    .venv/bin/python benchmarks/gguf_convert_vs_in_place.py /tmp/llama-1b.q8_0.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

KINDS = {"converted": 1 << 62, "in place": 0}  # gguf_fp32_max_bytes
PROMPT = "The capital of France is"


def timed(llm: LLM, max_tokens: int) -> tuple[float, float]:
    """(wall s, calling thread's CPU s) of one greedy generate."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.thread_time()
    llm.generate(PROMPT, params)
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens a round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    llms = {
        kind: LLM(args.gguf, gguf_fp32_max_bytes=knob, threads=args.threads,
                  kv_cache_bytes=128 << 20)
        for kind, knob in KINDS.items()
    }  # fmt: skip
    steps: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for llm in llms.values():
        timed(llm, 4)  # warm-up
    for _ in range(args.rounds):
        for kind, llm in llms.items():
            one, more = timed(llm, 1), timed(llm, 1 + args.tokens)
            steps[kind].append(tuple((b - a) / args.tokens * 1e3 for a, b in zip(one, more)))
    for kind, rounds in steps.items():
        wall = ", ".join(f"{w:.1f}" for w, _ in rounds)
        cpu = statistics.median(c for _, c in rounds)
        print(f"{kind}: {statistics.median(w for w, _ in rounds):.1f} ms/token wall "
              f"(rounds {wall}), {cpu:.1f} ms/token CPU of the calling thread")  # fmt: skip


if __name__ == "__main__":
    main()
