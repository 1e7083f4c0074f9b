"""The C kernels of `csrc/` (one file per kernel family, see csrc/kernels.h): built on first
use into one library, loaded with ctypes.

Why C and not more PyTorch: at decode's shapes PyTorch's CPU paths are bound by things
other than the hardware. A batch-1 fp32 GEMV in MKL or oneDNN runs on one core (~11 GB/s
here, where both cores read ~23), and decode attention first gathers every request's K/V
into a dense copy before SDPA reads it again. The kernels read each weight row once with
all threads, and read K/V in place from the paged cache.

Plain C with no PyTorch headers compiles in about a second with the system `gcc`, into
`<model cache>/_kernels/<hash of sources and flags>.so`, once per machine (a different source
or flags gives a new file; a concurrent build by another process is harmless: each writes a
temporary file and renames it). It is linked against the OpenMP runtime PyTorch already
loaded, so both share one thread pool and `torch.set_num_threads`.

The sources build in five variants (`ISA_FLAGS`), AVX2, AVX-512, each with or without VNNI's
integer dot products, and AMX (AVX-512 plus AMX bf16 tiles for GEMMs of 16 rows or more on
compact panels), the widest this CPU runs chosen at load time, or the one PDSERVE_CPU_ISA
names (auto|avx2|avx2vnni|avx512|avx512vnni|amx); the variant sets the
panel width weights are packed in (docs/cpu-kernels.md). Where a variant cannot be built
the next narrower one is tried; without a compiler, AVX2/FMA or a CPU device, `load()`
returns None and callers keep the PyTorch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from pdserve import envs
from pdserve.model import panel_codec
from pdserve.model.cpu_flags import cpu_flags
from pdserve.model.kv_cache import LayerCache
from pdserve.model.registry import default_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# Widest first: `auto` takes the first one the CPU runs. The AVX-512 set is Skylake-SP's
# (every AVX-512 server CPU has it); gcc would otherwise keep auto-vectorized loops 256-bit.
# `amx` is the AVX-512 build plus the AMX bf16 GEMM of compact panels (csrc/gemm_amx.c).
# The `*vnni` builds take the int8 GGUF kernels' integer sums in VNNI's vpdpbusd / vpdpwssd
# (csrc/quant_dot.c; bit-identical to maddubs + madd): AVX512_VNNI on Cascade Lake, Ice Lake
# and Zen 4/5 (every AMX CPU has it), AVX-VNNI on AVX2 CPUs from Alder Lake and Zen 5.
_AVX512 = [
    "-mavx512f",
    "-mavx512vl",
    "-mavx512bw",
    "-mavx512dq",
    "-mfma",
    "-mf16c",
    "-mprefer-vector-width=512",
]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "amx": [*_AVX512, "-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-mavx512vnni"],
    "avx512vnni": [*_AVX512, "-mavx512vnni"],
    "avx512": _AVX512,
    "avx2vnni": [*_AVX2, "-mavxvnni"],
    "avx2": _AVX2,
}
_AVX512_CPU = ("avx512f", "avx512vl", "avx512bw", "avx512dq", "f16c")
_AVX2_CPU = ("avx2", "fma", "f16c")
CPU_FLAGS = {
    "amx": (*_AVX512_CPU, "amx_tile", "amx_bf16", "avx512_bf16", "avx512_vnni"),
    "avx512vnni": (*_AVX512_CPU, "avx512_vnni"),
    "avx512": _AVX512_CPU,
    "avx2vnni": (*_AVX2_CPU, "avx_vnni"),
    "avx2": _AVX2_CPU,
}
# Up to this many rows (decode batches) the panel kernel runs the linears; above it (prefill
# chunks) oneDNN's blocked GEMM, where a worker keeps both weight copies, except where the
# panels take any rows (`panels_take_any_rows`: compact panels on the AMX kernels).
PANEL_M_MAX = 64

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def cpu_supports(isa: str) -> bool:
    """Whether this CPU runs the `isa` variant (False where /proc/cpuinfo is unreadable)."""
    return all(f in cpu_flags() for f in CPU_FLAGS[isa])


def build(isa: str = "avx2", out_dir: Path | None = None) -> Path:
    """Compile the `isa` variant of the kernels (if not already) and return its path."""
    cc = envs.c_compiler()
    flags = [*FLAGS, *ISA_FLAGS[isa]]
    sources = sorted(CSRC.glob("*.c"))
    digest = hashlib.sha256(" ".join([cc, *flags]).encode())
    for path in sorted(CSRC.glob("*.[ch]")):  # the key covers the header too
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    key = digest.hexdigest()[:16]
    out_dir = out_dir or default_cache_dir() / "_kernels"
    lib = out_dir / f"cpu_kernels-{isa}-{key}.so"
    if lib.exists():
        return lib
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, sources), "-o", tmp], check=True, capture_output=True)
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {CSRC} for {isa} failed: {e.stderr.decode()[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernels of variant `isa` (default: PDSERVE_CPU_ISA, else `auto`: the widest
    this CPU runs), or None (logged once) where none can run. The library carries `isa` and
    `panel_width` (output columns per packed panel) as attributes."""
    isa = isa or envs.cpu_isa()
    if isa != "auto" and isa not in ISA_FLAGS:
        raise ValueError(f"{envs.CPU_ISA}={isa!r}: expected one of auto, {', '.join(ISA_FLAGS)}")
    return _load(isa)


@cache
def _load(isa: str) -> ctypes.CDLL | None:
    if not envs.native_kernels_allowed():
        return None
    for variant in ISA_FLAGS if isa == "auto" else [isa]:
        if not cpu_supports(variant):
            log.info("native CPU kernels: this CPU cannot run the %s variant", variant)
            continue
        try:
            lib = _declare(ctypes.CDLL(str(build(variant))))
        except (RuntimeError, OSError) as e:
            log.warning("native CPU kernels: the %s variant is unavailable: %s", variant, e)
            continue
        if variant == "amx" and lib.pd_amx_init() != 0:
            log.warning("native CPU kernels: Linux refused this process the AMX tile state")
            continue
        lib.isa, lib.panel_width = variant, lib.pd_panel_width()
        # Rows from which compact-panel GEMMs take the AMX path (none below this variant).
        lib.amx_m_min = lib.pd_amx_m_min() if variant == "amx" else None
        log.info("native CPU kernels: %s (%d-column weight panels)", variant, lib.panel_width)
        return lib
    log.info("native CPU kernels off (PyTorch paths used instead)")
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument and result types of every kernel."""
    lib.pd_panel_width.argtypes = []
    lib.pd_panel_width.restype = _i64
    if hasattr(lib, "pd_amx_init"):
        lib.pd_amx_init.argtypes = lib.pd_amx_m_min.argtypes = []
        lib.pd_amx_init.restype, lib.pd_amx_m_min.restype = ctypes.c_int, _i64
    lib.pd_linear_panels.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]
    lib.pd_linear_panels.restype = ctypes.c_int
    lib.pd_paged_decode_attn.argtypes = [_ptr, _i64] + [_ptr] * 5 + [_i64] * 6 + [_f32]
    lib.pd_paged_decode_attn.restype = ctypes.c_int
    lib.pd_rmsnorm.argtypes = [_ptr] * 3 + [_i64] * 2 + [_f32]
    lib.pd_rmsnorm.restype = None
    lib.pd_add_rmsnorm.argtypes = [_ptr] * 4 + [_i64] * 2 + [_f32]
    lib.pd_add_rmsnorm.restype = None
    lib.pd_rope_qkv_store.argtypes = [_ptr] * 6 + [_i64] * 5
    lib.pd_rope_qkv_store.restype = None
    lib.pd_silu_mul.argtypes = [_ptr] * 2 + [_i64] * 2
    lib.pd_silu_mul.restype = None
    lib.pd_decode_layer_scratch.argtypes = [_i64] * 6
    lib.pd_decode_layer_scratch.restype = _i64
    lib.pd_decode_layers.argtypes = [_ptr, _ptr, _i64, _ptr, _i64] + [_ptr] * 7 + [_i64] * 7
    lib.pd_decode_layers.argtypes += [_f32, _i64]
    lib.pd_decode_layers.restype = ctypes.c_int
    lib.pd_argmax_rows.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.pd_argmax_rows.restype = None
    lib.pd_quant_row_bytes.argtypes = [_i64, _i64]
    lib.pd_quant_row_bytes.restype = _i64
    lib.pd_quant_rows.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr]
    lib.pd_quant_rows.restype = ctypes.c_int
    lib.pd_quant_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64]
    lib.pd_q8_dot_type.argtypes = [_i64, _i64]
    lib.pd_q8_dot_type.restype = ctypes.c_int
    lib.pd_q8_row_bytes.argtypes = [_i64]
    lib.pd_q8_row_bytes.restype = _i64
    lib.pd_q8_tile_type.argtypes = [_i64, _i64]
    lib.pd_q8_tile_type.restype = ctypes.c_int
    lib.pd_q8_quantize.argtypes = [_ptr, _i64, _ptr]
    lib.pd_q8_quantize.restype = None
    lib.pd_quant_linear.restype = ctypes.c_int
    if hasattr(lib, "pd_quant_linear_amx"):
        lib.pd_quant_linear_amx.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64]
        lib.pd_quant_linear_amx.restype = ctypes.c_int
        lib.pd_quant_amx_type.argtypes = [_i64]
        lib.pd_quant_row_bf16.argtypes = [_i64, _ptr, _ptr, _i64]
        lib.pd_quant_row_bf16.restype = ctypes.c_int
        lib.pd_quant_amx_type.restype = ctypes.c_int
    return lib


def reads_in_place(cache, q: torch.Tensor) -> bool:
    """Whether the attention kernel can read this layer's blocks directly: full-precision
    fp32 rows on the CPU (8-bit rows need dequantizing; the PyTorch path does that)."""
    blocks = cache.blocks
    return (
        type(cache).decode is LayerCache.decode
        and blocks.dtype == torch.float32 == q.dtype
        and blocks.device.type == "cpu"
        and blocks.is_contiguous()
    )


class PdWeight(ctypes.Structure):
    """The C side's `pd_weight`: a packed weight and its format."""

    _fields_ = [("data", ctypes.c_void_p), ("codec", ctypes.c_int64)]


class PdLayer(ctypes.Structure):
    """The C side's `pd_layer`: one decoder layer's parameters and KV cache, for
    `pd_decode_layers`. It holds raw pointers: whoever builds it keeps the tensors alive."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("w", PdWeight * 4),
        ("cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
    ]


class PdQuantPart(ctypes.Structure):
    """The C side's `pd_qpart`: one GGUF weight of a fused linear (quant_linear.py)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("rowmap", ctypes.c_void_p),
    ]


# The codecs of a `PdWeight` that is no panel but a `PdQuantLinear` (GGUF weights read in place):
# above its `gemv_m_max` rows, int8 activations or (PD_GGUF_AMX) AMX bf16 tiles.
PD_GGUF, PD_GGUF_AMX = 3, 4


class PdQuantLinear(ctypes.Structure):
    """The C side's `pd_qlinear`: a fused linear's GGUF parts, for `pd_decode_layers`."""

    _fields_ = [
        ("parts", ctypes.POINTER(PdQuantPart)),
        ("n", ctypes.c_int64),
        ("gemv_m_max", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class PanelWeight:
    """A linear weight packed for `linear_panels`: `panel`-column panels (the width of the
    kernel variant it was packed for), in fp32 or a lossless compact format (panel_codec.py)."""

    data: torch.Tensor
    codec: int
    out_features: int
    in_features: int
    panel: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def as_c(self) -> PdWeight:
        return PdWeight(self.data.data_ptr(), self.codec)


def pack_panels(lib: ctypes.CDLL, weight: torch.Tensor, compact: bool = True) -> PanelWeight:
    """Pack an [N, K] weight for `lib` into ceil(N / P) panels (P = lib.panel_width), each
    holding its P output columns side by side for every k (zero-padded past N) — in the
    smallest format that reproduces every weight bit for bit (`compact=False`: always fp32)."""
    n, k = weight.shape
    codec, data = panel_codec.encode(weight, lib.panel_width, compact)
    return PanelWeight(data, codec, n, k, lib.panel_width)


def panels_take_any_rows(lib: ctypes.CDLL | None, weight: PanelWeight | None = None) -> bool:
    """Whether `linear_panels` beats oneDNN at prefill sizes too (past PANEL_M_MAX rows): on
    the AMX kernels, for compact panels (`weight`, if given; fp32 ones keep the AVX-512 GEMM)."""
    return (
        lib is not None and lib.isa == "amx" and (weight is None or weight.codec != panel_codec.F32)
    )


def linear_panels(
    lib: ctypes.CDLL, x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [M, K] with `weight = pack_panels(lib, w)`."""
    if weight.panel != lib.panel_width:
        raise ValueError(f"weight packed in {weight.panel}-column panels for {lib.isa} kernels")
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, weight.out_features, dtype=x.dtype)
    b = bias.data_ptr() if bias is not None else None
    rc = lib.pd_linear_panels(
        x.data_ptr(),
        weight.data.data_ptr(),
        weight.codec,
        b,
        y.data_ptr(),
        m,
        weight.out_features,
        k,
    )
    if rc != 0:
        raise MemoryError("the panel GEMM could not allocate its expansion buffer")
    return y


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, heads, d] (rows may be strided, as in a fused QKV output) against the paged
    K/V of `blocks` [num_blocks, 2, kv_heads, block_size, d] -> [B, heads, d].
    `block_tables` [B, max_blocks] and `context_lens` [B] are int64; `scores` [B, max_blocks],
    if given, gains each block's attention probability summed over heads."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    b, heads, d = q.shape
    _, _, kv_heads, block_size, _ = blocks.shape
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty(b, heads, d)
    rc = lib.pd_paged_decode_attn(
        q.data_ptr(),
        q.stride(0),
        blocks.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        scores.data_ptr() if scores is not None else None,
        b,
        heads,
        kv_heads,
        d,
        block_size,
        tables.shape[1],
        d**-0.5,
    )
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch buffer")
    return out


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the last dim of a contiguous [M, D] fp32 tensor."""
    y = torch.empty_like(x)
    lib.pd_rmsnorm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def add_rmsnorm(
    lib: ctypes.CDLL, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += add (in place: the residual stream), then returns rms_norm(x)."""
    y = torch.empty_like(x)
    lib.pd_add_rmsnorm(
        x.data_ptr(), add.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps
    )
    return y


def rope_qkv_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    blocks: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
) -> None:
    """In place on qkv [T, (heads + 2 kv_heads) d]: RoPE on q and k; k and v stored at their
    slots of `blocks` [num_blocks, 2, kv_heads, block_size, d]."""
    _, _, kv_heads, block_size, d = blocks.shape
    lib.pd_rope_qkv_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        blocks.data_ptr(),
        slot_blocks.data_ptr(),
        slot_offsets.data_ptr(),
        qkv.shape[0],
        num_heads,
        kv_heads,
        d,
        block_size,
    )


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate | up) -> silu(gate) * up, [M, I]."""
    m, two_i = gate_up.shape
    y = torch.empty(m, two_i // 2)
    lib.pd_silu_mul(gate_up.data_ptr(), y.data_ptr(), m, two_i // 2)
    return y


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a contiguous fp32 [M, N], on every thread (NaN and ties as torch)."""
    x = x.contiguous()
    m, n = x.shape
    out = torch.empty(m, dtype=torch.int64)
    lib.pd_argmax_rows(x.data_ptr(), m, n, out.data_ptr())
    return out
