"""CPU kernels at the default model's shapes (docs/cpu-kernels.md): the native panel GEMM against
oneDNN and `F.linear` on random fp32 or GGUF-grid weights, and paged decode attention against
gather + SDPA; `--isa` and `--vs` two native variants. `--weights in-place`: an 8192x2048 GGUF
matrix of each `--types` read in place, `hot` and `streamed` past the caches (at `--threads 1`
the calling thread's CPU time, else wall time), and what the AVX2 tile kernels' broadcasts cost
one core: a loop of nothing but their step (broadcast, `maddubs`, 16-bit add) against the same
loop without the broadcast. Medians; run on an idle machine.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from bench_engine import timed

from pdserve import envs
from pdserve.model import native
from pdserve.model.attention import AttentionMetadata, attend, decode_tables
from pdserve.model.kv_cache import LayerCache

LINEARS = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def gguf_grid(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w rounded onto a GGUF quantization grid (what the loader makes of a GGUF tensor)."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    return torch.from_numpy(quants.dequantize(quants.quantize(w.numpy() * 0.05, t), t).copy())


def linear_times(libs, w: torch.Tensor, m: int, repeats: int) -> list[float]:
    """Seconds for x [m, K] @ w.T: each of `libs`' panel kernels, oneDNN, F.linear —
    interleaved, a few rounds of each, the best round's median kept (a shared machine's
    other load lands on every column alike)."""
    n, k = w.shape
    x = torch.randn(m, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    panels = [(lib, native.pack_panels(lib, w)) for lib in libs]
    calls = [lambda lib=lib, p=p: native.linear_panels(lib, x, p, None) for lib, p in panels]
    calls += [
        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        lambda: F.linear(x, w),
    ]
    rounds = [[timed(f, max(1, repeats // 3)) for f in calls] for _ in range(3)]
    return [min(r[i] for r in rounds) for i in range(len(calls))]


def bench_linears(libs, rows: list[int], repeats: int, weights: str) -> None:
    native_cols = [f"native {lib.isa}" for lib in libs]
    print(
        f"| linear | rows | {' | '.join(native_cols)} | oneDNN | F.linear | oneDNN time / native |"
    )
    print("|---|---|" + "---|" * (len(libs) + 3))
    for name, (n, k) in LINEARS.items():
        w = torch.randn(n, k)
        if weights == "gguf":
            w = gguf_grid(w, "Q8_0" if name == "lm_head" else "Q4_1")
        for m in rows:
            times = linear_times(libs, w, m, repeats)
            flops, weight_bytes = 2 * m * n * k, n * k * 4
            cells = [
                f"{t * 1e6:.0f} us, {flops / t / 1e9:.0f} GF, {weight_bytes / t / 1e9:.1f} GB/s"
                for t in times
            ]
            ratio = times[len(libs)] / times[0]
            print(f"| {name} {n}x{k} | {m} | {' | '.join(cells)} | {ratio:.2f}x |")


IN_PLACE_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"]


def in_place_times(lib, qtype: str, m: int, repeats: int, stream_bytes: int) -> tuple[dict, int]:
    """({(activations, "hot" | "streamed"): seconds}, matrix bytes) for x [m, 2048] against
    an 8192x2048 `qtype` matrix read in place; the activation modes interleave, the best of
    3 rounds."""
    from gguf import GGMLQuantizationType

    from pdserve.model import quant_linear
    from pdserve.model.quant_linear import QuantLinear, QuantTensor
    from pdserve.model.synthetic import random_matrix

    n, k, t = 8192, 2048, GGMLQuantizationType[qtype]
    base = random_matrix((n, k), t, np.random.default_rng(0)).reshape(n, -1)
    copies = [np.roll(base, i, axis=0) for i in range(max(2, stream_bytes // base.nbytes))]
    linears = [QuantLinear(lib, [QuantTensor(c, int(t), n, k, qtype)]) for c in copies]
    modes = many_row_modes(lib, m) if m > quant_linear.QUANT_GEMV_M_MAX else {"fp32": {}}
    if m <= quant_linear.QUANT_GEMV_M_MAX and lib.pd_q8_dot_type(int(t), k):
        modes["int8"] = {"INT8_M_MAX": max(m, quant_linear.INT8_M_MAX)}
    x, best = torch.randn(m, k), {}
    modes["fp32"] = {"INT8_M_MAX": 0, "AMX_TILES": False, **modes["fp32"]}
    default = {name: getattr(quant_linear, name) for v in modes.values() for name in v}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    try:
        for _ in range(3):
            for mode, settings in modes.items():
                for name, value in {**default, **settings}.items():
                    setattr(quant_linear, name, value)
                linears[0](x)
                hot = []
                for _ in range(max(1, repeats // 3)):
                    start = clock()
                    linears[0](x)
                    hot.append(clock() - start)
                hot = sorted(hot)[len(hot) // 2]
                start = clock()
                for linear in linears:
                    linear(x)
                streamed = (clock() - start) / len(linears)
                for key, s in (((mode, "hot"), hot), ((mode, "streamed"), streamed)):
                    best[key] = min(best.get(key, s), s)
    finally:
        for name, value in default.items():
            setattr(quant_linear, name, value)
    return best, base.nbytes


def many_row_modes(lib, m: int) -> dict[str, dict]:
    """Above QUANT_GEMV_M_MAX rows: the fp32 dequantize-and-GEMM path against AMX bf16 tiles
    (the amx kernels) or, elsewhere, the int8 kernel taken past its row limit."""
    if hasattr(lib, "pd_quant_linear_amx"):
        return {"fp32": {}, "amx": {"AMX_TILES": True}}
    return {"fp32": {}, "int8": {"QUANT_GEMV_M_MAX": m, "INT8_M_MAX": m}}


# The AVX2 tile kernels' step (quant_dot.c), 32 int8 products: `maddubs` of a weight vector
# and 4 activation bytes, added to a 16-bit sum; 8 independent sums. Written in assembly so
# the compiler neither folds equal steps into one nor adds register moves: with a broadcast of
# the 4 bytes from memory per step, and without (the activations held in registers).
INT8_PEAK_C = r"""
#include <stdio.h>
#include <time.h>
static unsigned char buf[64] __attribute__((aligned(64)));
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define B(i) "vpbroadcastd " #i "*4(%1), %%ymm9\n vpmaddubsw %%ymm9, %%ymm8, %%ymm9\n" \
             "vpaddw %%ymm9, %%ymm" #i ", %%ymm" #i "\n"
#define R(i, c) "vpmaddubsw %%ymm" #c ", %%ymm8, %%ymm9\n vpaddw %%ymm9, %%ymm" #i ", %%ymm" #i "\n"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
                "xmm12", "xmm13", "xmm14", "xmm15", "cc"
/* n iterations of `steps`, the weights and activations loaded into registers first, in one
 * statement so nothing the compiler emits runs between them */
#define LOOP(steps) { long k = n; __asm__ volatile( \
        "vmovdqu (%1), %%ymm8\n vmovdqu 32(%1), %%ymm12\n vmovdqa %%ymm12, %%ymm13\n" \
        "vmovdqa %%ymm8, %%ymm14\n vmovdqa %%ymm12, %%ymm15\n" \
        "1:\n" steps "dec %0\n jnz 1b\n" : "+r"(k) : "r"(buf) : CLOBBER); }
int main(void) {
    const long n = 50000000;
    for (int i = 0; i < 64; i++) buf[i] = (unsigned char)(i * 7);
    double t = now();
    LOOP(B(0) B(1) B(2) B(3) B(4) B(5) B(6) B(7))
    printf("%f\n", 8.0 * 32 * n / (now() - t) / 1e9);
    t = now();
    LOOP(R(0, 12) R(1, 13) R(2, 14) R(3, 15) R(4, 12) R(5, 13) R(6, 14) R(7, 15))
    printf("%f\n", 8.0 * 32 * n / (now() - t) / 1e9);
    return 0;
}
"""


def int8_step_loop() -> tuple[float, float] | None:
    """G int8 products a second on one core: (broadcast + maddubs + add, maddubs + add); None
    where the C compiler or AVX2 is missing."""
    if not native.cpu_supports("avx2"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "peak.c"), Path(tmp, "peak")
        src.write_text(INT8_PEAK_C)
        try:
            subprocess.run([envs.c_compiler(), "-O2", "-mavx2", src, "-o", exe], check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        bcast, plain = map(
            float, subprocess.run([exe], capture_output=True, text=True).stdout.split()
        )
    return bcast, plain


def bench_in_place(libs, rows: list[int], repeats: int, stream_mb: int, types: list[str]) -> None:
    if loop := int8_step_loop():
        print(
            f"int8 step loop, one core: {2 * loop[0]:.0f} GFLOP/s with a broadcast per maddubs "
            f"(the tile kernels' step), {2 * loop[1]:.0f} without\n"
        )
    print(
        "| type 8192x2048 | rows | native | fp32 hot | fp32 streamed | path | hot "
        "| streamed | fp32 / path streamed | path GFLOP/s hot |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qtype in types:
        for m in rows:
            for lib in libs:
                t, nbytes = in_place_times(lib, qtype, m, repeats, stream_mb << 20)
                path = next((mode for mode, _ in t if mode != "fp32"), None)
                cells = [
                    f"{t[key] * 1e3:.2f} ms, {nbytes / t[key] / 1e9:.1f} GB/s" if key in t else "-"
                    for key in itertools.product(("fp32", path), ("hot", "streamed"))
                ]
                ratio = t[("fp32", "streamed")] / t[(path, "streamed")] if path else None
                flops = 2 * m * 8192 * 2048 / t[(path, "hot")] / 1e9 if path else None
                print(
                    f"| {qtype} | {m} | {lib.isa} | {' | '.join(cells[:2])} | {path or '-'} | "
                    f"{' | '.join(cells[2:])} | {f'{ratio:.2f}x' if ratio else '-'} | "
                    f"{f'{flops:.0f}' if flops else '-'} |"
                )


def attention_times(lib, b: int, context: int, repeats: int) -> tuple[float, float]:
    """(native, PyTorch) seconds for one layer's decode attention, SmolLM2's heads."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    per_seq = -(-context // bs)
    blocks = torch.randn(b * per_seq + 1, 2, kv_heads, bs, d)
    ids = torch.randperm(b * per_seq).view(b, per_seq) + 1
    tables, mask = decode_tables(ids.tolist(), [context] * b, bs, torch.device("cpu"))
    lens = torch.full((b,), context)
    zeros = torch.zeros(b, dtype=torch.long)
    meta = AttentionMetadata(zeros, zeros, b, tables, mask, lens)
    q, kv = torch.randn(b, heads, d), torch.randn(b, kv_heads, d)
    cache = LayerCache(blocks)
    return (
        timed(lambda: native.paged_decode_attention(lib, q, blocks, tables, lens), repeats),
        timed(lambda: attend(q, kv, kv, cache, meta), repeats),
    )


def bench_attention(lib, batches: list[int], context: int, repeats: int) -> None:
    print(f"\n| decode attention ({context}-token contexts), batch | native | PyTorch | speed-up |")
    print("|---|---|---|---|")
    for b in batches:
        ours, theirs = attention_times(lib, b, context, repeats)
        print(f"| {b} | {ours * 1e6:.0f} us | {theirs * 1e6:.0f} us | {theirs / ours:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--isa", choices=["auto", *native.ISA_FLAGS], default=None)
    ap.add_argument("--weights", choices=["fp32", "gguf", "in-place"], default="fp32")
    ap.add_argument("--stream-mb", type=int, default=768, help="in-place: bytes of copies")
    types = [*IN_PLACE_TYPES, "BF16", "F16"]  # those two: Hugging Face checkpoints' matrices
    ap.add_argument("--types", nargs="+", choices=types, default=IN_PLACE_TYPES)
    ap.add_argument("--vs", choices=list(native.ISA_FLAGS), help="a second native variant")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.load(args.isa)
    if lib is None:
        raise SystemExit("native kernels unavailable on this machine (see the log line above)")
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}, native: {lib.isa}, {args.weights} weights\n")
    libs = [lib] + ([native.load(args.vs)] if args.vs else [])
    if None in libs:
        raise SystemExit(f"the {args.vs} native kernels cannot run on this machine")
    with torch.inference_mode():
        if args.weights == "in-place":
            return bench_in_place(libs, args.rows, args.repeats, args.stream_mb, args.types)
        bench_linears(libs, args.rows, args.repeats, args.weights)
        bench_attention(lib, [1, 8, 32], args.context, args.repeats)


if __name__ == "__main__":
    main()
