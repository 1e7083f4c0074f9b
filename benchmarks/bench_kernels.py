"""CPU kernels at the default model's shapes: the native panel GEMM against oneDNN (prepacked)
and `F.linear`, and native paged decode attention against gather + SDPA.

    .venv/bin/python benchmarks/bench_kernels.py [--threads 2] [--repeats 30] [--isa avx2]
        [--weights gguf] [--vs avx512]

SmolLM2-135M's linear shapes at decode (1..64 rows) and prefill (512) row counts, random fp32
weights or (`--weights gguf`) weights on the GGUF's grids, stored as compact panels. Medians;
GB/s counts fp32 weight bytes once per call. `--isa` picks the native variant (default: the
widest this CPU runs), `--vs` a second one in the same run (`--isa amx --vs avx512 --weights
gguf`). Columns interleave. Run on an idle machine.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_engine import timed

from pdserve.model import native
from pdserve.model.attention import AttentionMetadata, attend, decode_tables
from pdserve.model.kv_cache import LayerCache

LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
           "lm_head": (49152, 576)}  # fmt: skip


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
    calls += [lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
              lambda: F.linear(x, w)]  # fmt: skip
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
            cells = [f"{t * 1e6:.0f} us, {flops / t / 1e9:.0f} GF, "
                     f"{weight_bytes / t / 1e9:.1f} GB/s" for t in times]  # fmt: skip
            ratio = times[len(libs)] / times[0]
            print(f"| {name} {n}x{k} | {m} | {' | '.join(cells)} | {ratio:.2f}x |")


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--isa", choices=["auto", *native.ISA_FLAGS], default=None)
    ap.add_argument("--weights", choices=["fp32", "gguf"], default="fp32")
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
        bench_linears(libs, args.rows, args.repeats, args.weights)
        bench_attention(lib, [1, 8, 32], args.context, args.repeats)


if __name__ == "__main__":
    main()
