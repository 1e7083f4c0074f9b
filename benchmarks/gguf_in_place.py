"""A GGUF read in place through `LLM` (docs/cpu-kernels.md): decode ms a step against the bound
the read bandwidth sets, prefill (`--compare`: AMX or int8 tiles against the fp32 GEMM, int8 against
fp32 decode activations), `--vs-converted` the file as fp32 panels, peak RSS and PSS; each step's
CPU time on the calling thread beside its wall time (at `--threads 1` the kernels run there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def read_bandwidth(array: np.ndarray) -> float:
    """GB/s of a numpy sum over `array` (the best of 2)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        array.sum()
        best = min(best, time.perf_counter() - t0)
    return array.nbytes / best / 1e9


def proc_kb(field: str, path: str = "/proc/self/status") -> int:
    for line in open(path):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def time_prefill(llm, tokens: int, rounds: int, compare: bool) -> dict[str, tuple[float, float]]:
    """Best (wall, calling thread's CPU) seconds of a `tokens`-token prompt's prefill (one output
    token) per many-row path: AMX bf16 tiles (csrc/quant_amx.c) or, on the AVX2 kernels, Q4_K
    rows packed eight at a time against int8 activations (csrc/quant_dot.c), where the kernels
    have them, and, with `compare`, the fp32 dequantize-and-GEMM path, interleaved round by
    round; distinct prompts per round."""
    from pdserve.model import native, quant_linear
    from pdserve.sampling_params import SamplingParams

    lib = native.load()
    modes: dict[str, dict] = {}
    if hasattr(lib, "pd_quant_linear_amx"):
        modes["AMX tiles"] = {"AMX_TILES": True}
    elif lib is not None and lib.pd_q8_tile_type(12, 256):  # Q4_K
        modes["int8 tiles"] = {}
    if compare or not modes:
        modes["fp32 GEMM"] = {"AMX_TILES": False, "INT8_M_MAX": 0}
    default = {name: getattr(quant_linear, name) for mode in modes.values() for name in mode}
    once = SamplingParams(temperature=0, max_tokens=1)
    best: dict[str, tuple[float, float]] = {}
    try:
        for r in range(rounds):
            for i, (mode, settings) in enumerate(modes.items()):
                for name, value in {**default, **settings}.items():
                    setattr(quant_linear, name, value)
                prompt = [(7 * t + 13 * (r * len(modes) + i)) % 40000 + 100 for t in range(tokens)]
                t0, c0 = time.perf_counter(), time.thread_time()
                llm.generate([prompt], once)
                took = (time.perf_counter() - t0, time.thread_time() - c0)
                best[mode] = min(best.get(mode, took), took)
    finally:
        for name, value in default.items():
            setattr(quant_linear, name, value)
    return best


def load_llm(args: argparse.Namespace, gguf_fp32_max_bytes: int):
    from pdserve.llm import LLM

    limit = {"gguf_fp32_max_bytes": gguf_fp32_max_bytes}
    return LLM(str(args.gguf), kv_cache_bytes=256 * 2**20, threads=args.threads, **limit)


def decode_modes(llm, args: argparse.Namespace) -> dict[str, tuple]:
    """name -> (model, quant_linear.INT8_M_MAX) of each decode timed round by round: int8
    activations; with `--compare` fp32 ones; with `--vs-converted` the same file converted to
    fp32 panels (`gguf_fp32_max_bytes` past its size, model/gguf_convert.py)."""
    from pdserve.model import quant_linear

    modes = {"int8": (llm, quant_linear.INT8_M_MAX)}
    if args.compare:
        modes["fp32"] = (llm, 0)
    if args.vs_converted:
        converted = load_llm(args, gguf_fp32_max_bytes=1 << 62)
        modes["converted"] = (converted, quant_linear.INT8_M_MAX)
    return modes


def time_decode(modes: dict[str, tuple], args: argparse.Namespace) -> tuple[dict, list[float]]:
    """Each mode's decode steps, (wall, calling thread's CPU) seconds, and the numpy read
    bandwidth measured before each round."""
    from pdserve.model import quant_linear
    from pdserve.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    array = np.ones(2**29, np.float32)  # 2 GiB
    steps, bandwidths = {mode: [] for mode in modes}, []
    default = quant_linear.INT8_M_MAX
    try:
        for r in range(args.rounds):
            bandwidths.append(read_bandwidth(array))
            for mode, (llm, m_max) in modes.items():
                quant_linear.INT8_M_MAX = m_max
                prompts = [[1, 2, 3, 4 + r, 5 + i] for i in range(args.batch)]
                stamps = [
                    (time.perf_counter(), time.thread_time()) for _ in llm.stream(prompts, greedy)
                ]
                # a step yields one token of each sequence; its last one ends the step
                ends = np.array(stamps)[args.batch - 1 :: args.batch]
                steps[mode] += np.diff(ends, axis=0).tolist()  # after the first token: decode
    finally:
        quant_linear.INT8_M_MAX = default
    return steps, bandwidths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens a round")
    parser.add_argument("--prefill", type=int, default=512, help="0: no prefill timed")
    parser.add_argument("--compare", action="store_true", help="int8/fp32, AMX/fp32 GEMM")
    parser.add_argument("--vs-converted", action="store_true", help="also as fp32 panels")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    args = parser.parse_args()

    from pdserve.model.quant_linear import QuantEmbedding, QuantLinear

    t0 = time.perf_counter()
    llm = load_llm(args, gguf_fp32_max_bytes=0)
    load_s = time.perf_counter() - t0
    modules = list(llm.engine.runner.model.modules())
    if not any(isinstance(m, QuantEmbedding) for m in modules):
        raise SystemExit(f"{args.gguf}: no block type read in place (its types keep fp32)")
    # Bytes a decode step reads: every layer's matrices and the output head (not the table).
    step_bytes = sum(m.nbytes for m in modules if isinstance(m, QuantLinear))
    steps, bandwidths = time_decode(decode_modes(llm, args), args)
    prefill_s = time_prefill(llm, args.prefill, args.rounds, args.compare) if args.prefill else {}
    bw = statistics.median(bandwidths)
    print(f"load {load_s:.1f} s; weights read a step {step_bytes / 1e6:.0f} MB")
    bound_ms = step_bytes / bw / 1e6
    for mode, mode_steps in steps.items():
        ms, cpu_ms = (statistics.median(s[i] for s in mode_steps) * 1e3 for i in (0, 1))
        print(
            f"decode batch {args.batch}, {mode}: {ms:.1f} ms/step median of {len(mode_steps)} "
            f"(CPU {cpu_ms:.1f} ms on this thread; {step_bytes / ms / 1e6:.1f} GB/s of the "
            f"in-place weights); numpy read {bw:.1f} GB/s (bound {bound_ms:.1f} ms/step, "
            f"ratio {ms / bound_ms:.2f})"
        )
    for mode, (wall, cpu) in prefill_s.items():
        print(
            f"prefill {args.prefill} tokens, {mode}: {wall:.2f} s (CPU {cpu:.2f} s on this "
            f"thread; best of {args.rounds})"
        )
    if len(prefill_s) == 2:
        tiles = next(mode for mode in prefill_s if mode != "fp32 GEMM")
        ratio = prefill_s["fp32 GEMM"][0] / prefill_s[tiles][0]
        print(f"prefill fp32 GEMM / {tiles}: {ratio:.2f}x")
    print(
        f"peak RSS {proc_kb('VmHWM') / 2**20:.2f} GiB; now RSS "
        f"{proc_kb('Rss', '/proc/self/smaps_rollup') / 2**20:.2f} GiB, "
        f"PSS {proc_kb('Pss', '/proc/self/smaps_rollup') / 2**20:.2f} GiB"
    )


if __name__ == "__main__":
    main()
