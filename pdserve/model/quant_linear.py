"""Linear layers and embeddings whose weights stay in a GGUF file's own block layout.

Each weight is a `QuantTensor`: a read-only view of the bytes of one tensor of a memory-mapped
GGUF file, so the page cache holds the only copy of the weights, shared by every process of the
host that maps the same file. The native kernel `pd_quant_linear` (csrc/quant_gemm.c)
dequantizes each weight row into a per-thread fp32 buffer and multiplies every input row with
it, or (Q4_K, Q6_K, Q8_0, up to `INT8_M_MAX` rows) takes integer dot products with the input
rows quantized to int8 (csrc/quant_dot.c). Above `QUANT_GEMV_M_MAX` input rows (prefill
chunks, decode batches over 16): on AMX CPUs the block types, BF16 and F16 take AMX bf16
tiles (csrc/quant_amx.c); without AMX, linears of int8 types take int8 activations up to
`INT8_MANY_M_MAX` rows, and Q4_K/Q6_K/Q8_0 linears at any row count, eight weight rows packed
at a time (the AVX2 kernels); the rest dequantize a tile of weight rows once into a bounded
fp32 buffer for PyTorch's fp32 GEMM.
`QuantEmbedding` dequantizes only the rows it looks up.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pdserve.model import native
from pdserve.model.gguf_convert import BLOCKS

# Up to this many input rows the fused dequantize-and-multiply kernel runs; above it AMX tiles,
# the int8 kernel (INT8_MANY_M_MAX) or a tile of weight rows dequantized for PyTorch's GEMM.
QUANT_GEMV_M_MAX = 16
# Up to this many input rows, Q4_K, Q6_K and Q8_0 weights take each input row quantized to
# int8 (per 256 or 32 values) with integer dot products (csrc/quant_dot.c), as llama.cpp
# does; other types dequantize to fp32 (docs/cpu-kernels.md). The integer kernels unpack each
# weight block once for 4 input rows: 8192x2048, one thread, 16 rows took 1.8-2.1x less time
# than the fp32 kernel for Q4_K, 2.3-2.5x for Q6_K, and Q8_0 0.96x (AVX-512 without VNNI) to
# 1.25x (AVX2).
# A row's result is the same in any batch up to here. 0: never.
INT8_M_MAX = QUANT_GEMV_M_MAX
# Without AMX tiles, linears whose parts all have integer dot products (Q4_K, Q6_K, Q8_0) take
# int8 activations up to this many rows (csrc/quant_gemm.c passes 64 rows at a time): single
# thread, 8192x2048, the int8 kernel (~90-120 GFLOP/s) took 1.2-2.6x less time than the fp32
# GEMM path at 32-64 rows, 1.2-1.8x more at 128-512 (docs/cpu-kernels.md). 0: never.
INT8_MANY_M_MAX = 64
# fp32 floats of one dequantized tile on the GEMM path (16 MiB).
TILE_FLOATS = 1 << 22
# Above QUANT_GEMV_M_MAX rows, on the amx kernels, weights of block types (Q4_0 ... Q6_K),
# BF16 and F16 take AMX bf16 tiles (csrc/quant_amx.c: x and the dequantized weights rounded to
# bf16, within the int8 path's bound; BF16 weights as they are); F32 weights, and the other
# kernel variants, keep the fp32 dequantize-and-GEMM path (docs/cpu-kernels.md). False: never.
AMX_TILES = True
# On AMX tiles, weights without an integer dot product (Q4_0, Q4_1, Q5_*, BF16, F16) take the
# tiles above this many rows instead of QUANT_GEMV_M_MAX.
AMX_FLOAT_GEMV_M_MAX = 4


def int8_rows(m: int) -> int:
    """The `int8_m_max` of `pd_quant_linear` in a call of `m` rows: INT8_M_MAX up to
    QUANT_GEMV_M_MAX rows, above it `m` (called only where int8 activations apply)."""
    return INT8_M_MAX if m <= QUANT_GEMV_M_MAX else m


@dataclass(frozen=True)
class QuantTensor:
    """A [rows, cols] weight as `data` (uint8 [rows, row bytes], typically a view of a
    memory-mapped file) in ggml type `qtype`. `rowmap`, if given, is the order in which the
    kernels read the rows (undoing llama.cpp's Q/K row permutation without copying)."""

    data: np.ndarray
    qtype: int
    rows: int
    cols: int
    name: str = ""
    rowmap: torch.Tensor | None = None

    def __post_init__(self) -> None:
        values, nbytes = BLOCKS[self.qtype]
        if self.cols % values or self.data.shape != (self.rows, self.cols // values * nbytes):
            raise ValueError(
                f"tensor {self.name}: {self.data.shape} bytes do not hold a "
                f"[{self.rows}, {self.cols}] weight of type {self.qtype}"
            )
        if not self.data.flags.c_contiguous:
            raise ValueError(f"tensor {self.name}: rows are not contiguous")

    @property
    def ptr(self) -> int:
        return self.data.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize_rows(self, lib: ctypes.CDLL, first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) in the kernels' order, as fp32 [count, cols]."""
        out = torch.empty(count, self.cols)
        rows = None if self.rowmap is None else self.rowmap[first : first + count].data_ptr()
        rc = lib.pd_quant_rows(self.ptr, self.qtype, self.cols, rows, first, count, out.data_ptr())
        if rc != 0:
            raise ValueError(f"tensor {self.name}: type {self.qtype} not readable")
        return out


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) where W is the row-wise concatenation of `parts` (fused Q/K/V or
    gate/up weights stay separate tensors of the file, each written into its columns of y)."""

    def __init__(
        self, lib: ctypes.CDLL, parts: list[QuantTensor], bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if len({p.cols for p in parts}) != 1:
            raise ValueError("fused weights must share their input size")
        self.lib, self.parts, self.bias = lib, parts, bias
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self._parts_c = (native.PdQuantPart * len(parts))(
            *(
                native.PdQuantPart(
                    p.ptr, p.qtype, p.rows, None if p.rowmap is None else p.rowmap.data_ptr()
                )
                for p in parts
            )
        )
        self._linear_c = native.PdQuantLinear(self._parts_c, len(parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def amx_tiles(self) -> bool:
        """Whether calls above QUANT_GEMV_M_MAX rows take AMX bf16 tiles (csrc/quant_amx.c)."""
        return (
            AMX_TILES
            and hasattr(self.lib, "pd_quant_linear_amx")
            and all(self.lib.pd_quant_amx_type(p.qtype) for p in self.parts)
        )

    @property
    def int8_dot(self) -> bool:
        """Whether every part has an integer dot product (Q4_K, Q6_K, Q8_0: csrc/quant_dot.c)."""
        return all(self.lib.pd_q8_dot_type(p.qtype, p.cols) for p in self.parts)

    @property
    def gemv_m_max(self) -> int:
        """The most rows a call takes on `pd_quant_linear`; above them the AMX tiles, the int8
        kernel or the GEMM path. QUANT_GEMV_M_MAX, but AMX_FLOAT_GEMV_M_MAX where AMX tiles
        take the parts without an integer dot product: those dequantize every weight row to
        fp32 for each call and multiply it by each input row, a cost that grows with every
        row, while the tiles' cost barely grows with rows."""
        if self.amx_tiles and not (INT8_M_MAX > 0 and self.int8_dot):
            return AMX_FLOAT_GEMV_M_MAX
        return QUANT_GEMV_M_MAX

    @property
    def int8_many_rows(self) -> bool:
        """Whether calls of QUANT_GEMV_M_MAX to INT8_MANY_M_MAX rows take int8 activations:
        without AMX tiles, every part with an integer dot product, int8 switched on."""
        return INT8_M_MAX > 0 and not self.amx_tiles and self.int8_dot

    @property
    def int8_tiles(self) -> bool:
        """Whether calls of any number of rows take int8 activations: without AMX tiles, every
        part packed eight rows at a time for many input rows (Q4_K, Q6_K and Q8_0 on the AVX2
        kernels, csrc/quant_dot.c): at 64-512 rows 1.5-2x faster than the one-row int8 kernel,
        itself about as fast as the fp32 GEMM path there."""
        return self.int8_many_rows and all(
            self.lib.pd_q8_tile_type(p.qtype, p.cols) for p in self.parts
        )

    def _dequantize_then_matmul(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y = x W^T a tile of weight rows at a time, dequantized to fp32 (PyTorch's GEMM)."""
        col = 0
        for part in self.parts:
            tile = max(16, TILE_FLOATS // part.cols)
            for first in range(0, part.rows, tile):
                count = min(tile, part.rows - first)
                w = part.dequantize_rows(self.lib, first, count)
                y[:, col + first : col + first + count] = x @ w.T
            col += part.rows

    @property
    def native_m_max(self) -> int:
        """The most rows up to which every call takes a native kernel (and `pd_decode_layers`
        the same one): INT8_MANY_M_MAX where calls above QUANT_GEMV_M_MAX take AMX tiles or
        int8 activations, QUANT_GEMV_M_MAX where they dequantize for PyTorch's GEMM."""
        many = self.amx_tiles or self.int8_many_rows
        return max(INT8_MANY_M_MAX, QUANT_GEMV_M_MAX) if many else QUANT_GEMV_M_MAX

    def as_c(self) -> native.PdWeight:
        """This linear as a `pd_decode_layers` weight (valid while the module lives): its
        codec and `gemv_m_max` name the kernel `forward` takes for each row count."""
        codec = native.PD_GGUF_AMX if self.amx_tiles else native.PD_GGUF
        self._linear_c.gemv_m_max = self.gemv_m_max  # as forward decides now
        return native.PdWeight(ctypes.addressof(self._linear_c), codec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features)
        n, out = len(self.parts), self.out_features
        many = (
            INT8_MANY_M_MAX > 0
            and self.int8_many_rows
            and (m <= INT8_MANY_M_MAX or self.int8_tiles)
        )
        if m <= self.gemv_m_max or many:
            rc = self.lib.pd_quant_linear(
                x.data_ptr(),
                m,
                self.in_features,
                self._parts_c,
                n,
                y.data_ptr(),
                out,
                int8_rows(m),
            )
            if rc != 0:
                raise MemoryError("the quantized GEMV could not allocate its row buffer")
        elif self.amx_tiles:
            rc = self.lib.pd_quant_linear_amx(
                x.data_ptr(), m, self.in_features, self._parts_c, n, y.data_ptr(), out
            )
            if rc != 0:
                raise MemoryError("the AMX quantized GEMM could not allocate its buffers")
        else:
            self._dequantize_then_matmul(x, y)
        if self.bias is not None:
            y += self.bias
        return y.to(dtype).view(*lead, self.out_features)


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a quantized table: only the looked-up rows are dequantized."""

    def __init__(self, lib: ctypes.CDLL, table: QuantTensor) -> None:
        super().__init__()
        self.lib, self.table = lib, table
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.empty(flat.numel(), self.embedding_dim)
        rc = self.lib.pd_quant_rows(
            self.table.ptr,
            self.table.qtype,
            self.embedding_dim,
            flat.data_ptr(),
            0,
            flat.numel(),
            out.data_ptr(),
        )
        if rc != 0:
            raise ValueError(f"tensor {self.table.name}: type {self.table.qtype} not readable")
        return out.view(*ids.shape, self.embedding_dim)
