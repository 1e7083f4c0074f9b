"""KV cache storage formats: full precision, or FP8 (E4M3) with a scale per token and head.

Both keep one tensor per worker, `[layers, blocks, 2 (K|V), kv_heads, block_size, row]`,
where a block stays contiguous (one transfer write per block run). They differ in the row:

    auto:  row = head_dim values in the model's dtype
    fp8:   row = head_dim float8_e4m3fn bytes | 4 bytes of fp32 scale   (uint8 tensor)

Why one scale per (token, head): decode appends one token at a time. A per-block scale would
have to be fixed before the block's later tokens exist (clipping them) or the block would be
requantized as they arrive (compounding error); a per-token scale is exact to E4M3's 3
mantissa bits for every token, at 4 bytes per 64-value row (6%), so a block costs 26.6% of
fp32 (53% of bf16). The scale travels inside the block, so every transfer backend and storage
tier moves FP8 blocks and their scales as the same opaque bytes.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4


def row_size(head_dim: int, kv_cache_dtype: str) -> int:
    return head_dim + SCALE_BYTES if kv_cache_dtype == "fp8" else head_dim


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if kv_cache_dtype == "fp8" else model_dtype


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] uint8 rows (values, then the fp32 scale)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    values = (x.float() / scale).to(FP8).view(torch.uint8)
    return torch.cat((values, scale.view(torch.uint8)), dim=-1)


def dequantize_fp8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].contiguous().view(FP8).to(torch.float32)
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


class Fp8LayerCache(LayerCache):
    """Rows of FP8 values plus their scale; quantized on write, dequantized on read."""

    @property
    def head_dim(self) -> int:
        return self.blocks.shape[4] - SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_fp8(x)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(rows, dtype)


def layer_caches(kv_cache: torch.Tensor, kv_cache_dtype: str) -> list[LayerCache]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    cls = Fp8LayerCache if kv_cache_dtype == "fp8" else LayerCache
    return [cls(kv_cache[i]) for i in range(kv_cache.shape[0])]
