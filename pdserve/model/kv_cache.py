"""KV cache storage formats: full precision, or 8-bit rows with a scale per token and head.

All keep one tensor per worker, `[layers, blocks, 2 (K|V), kv_heads, block_size, row]`,
where a block stays contiguous (one transfer write per block run). They differ in the row:

    auto:  row = head_dim values in the model's dtype
    fp8:   row = head_dim float8_e4m3fn bytes | 4 bytes of fp32 scale   (uint8 tensor)
    int8:  row = head_dim int8 values         | 4 bytes of fp32 scale   (int8 tensor)

One scale per (token, head): decode appends one token at a time, so a per-block scale would
clip the block's later tokens or requantize it as they arrive; a per-token scale costs 4 bytes
per 64-value row (6%; a block costs 26.6% of fp32). The scale travels inside the block, so
every transfer backend and tier moves 8-bit blocks as opaque bytes. Why int8 next to fp8, and
the two pools' separate dtypes: docs/ARCHITECTURE.md, "KV cache layout"; BENCHMARKS.md §5.
"""

from __future__ import annotations

import torch

from pdserve.config import KV_CACHE_DTYPES

SCALE_BYTES = 4
# kv_cache_dtype -> (value dtype, largest value, pool tensor dtype)
QUANTIZED = {
    "fp8": (torch.float8_e4m3fn, 448.0, torch.uint8),
    "int8": (torch.int8, 127.0, torch.int8),
}


def row_size(head_dim: int, kv_cache_dtype: str) -> int:
    return head_dim + SCALE_BYTES if kv_cache_dtype in QUANTIZED else head_dim


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return QUANTIZED[kv_cache_dtype][2] if kv_cache_dtype in QUANTIZED else model_dtype


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] rows of the pool's dtype (values, then
    the fp32 scale). Int8 rounds to nearest (a plain cast would truncate)."""
    value_dtype, largest, pool_dtype = QUANTIZED[kv_cache_dtype]
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / largest).clamp_min(1e-12)
    scaled = x.float() / scale
    if not value_dtype.is_floating_point:
        scaled = scaled.round_().clamp_(-largest, largest)
    values = scaled.to(value_dtype).view(pool_dtype)
    return torch.cat((values, scale.view(pool_dtype)), dim=-1)


def dequantize(rows: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    value_dtype = QUANTIZED[kv_cache_dtype][0]
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].contiguous().view(value_dtype).to(torch.float32)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)


class LayerCache:
    """One layer's blocks, `[blocks, 2, kv_heads, block_size, row]`, in the model's dtype."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    @property
    def block_size(self) -> int:
        return self.blocks.shape[3]

    @property
    def head_dim(self) -> int:
        return self.blocks.shape[4]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows

    def write(self, k: torch.Tensor, v: torch.Tensor, block_ids, offsets) -> None:
        """Store new tokens' K/V ([tokens, kv_heads, head_dim]) at their slots."""
        self.blocks[block_ids, 0, :, offsets] = self.encode(k)
        self.blocks[block_ids, 1, :, offsets] = self.encode(v)

    def gather(
        self, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks: tables [B, n] -> ([kv_heads, B, n * block_size, d], same).

        One `index_select` over a [2, kv_heads, blocks, block_size, row] view copies each
        selected [block_size, row] tile straight into its final place; per-token indexing
        would compute an index per element and is several times slower on CPU.
        """
        _, _, num_kv_heads, block_size, row = self.blocks.shape
        batch, n = block_tables.shape
        tiles = self.blocks.permute(1, 2, 0, 3, 4).index_select(2, block_tables.view(-1))
        kv = self.decode(tiles.view(2, num_kv_heads, batch, n * block_size, row), dtype)
        return kv[0], kv[1]


class QuantizedLayerCache(LayerCache):
    """Rows of 8-bit values plus their scale; quantized on write, dequantized on read."""

    def __init__(self, blocks: torch.Tensor, kv_cache_dtype: str) -> None:
        super().__init__(blocks)
        self.kv_cache_dtype = kv_cache_dtype

    @property
    def head_dim(self) -> int:
        return self.blocks.shape[4] - SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return quantize(x, self.kv_cache_dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(rows, self.kv_cache_dtype, dtype)


def layer_caches(kv_cache: torch.Tensor, kv_cache_dtype: str) -> list[LayerCache]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype in QUANTIZED:
        return [QuantizedLayerCache(kv_cache[i], kv_cache_dtype) for i in range(kv_cache.shape[0])]
    return [LayerCache(kv_cache[i]) for i in range(kv_cache.shape[0])]
