"""Mixed KV dtypes across a disaggregated pair (e.g. an fp32 prefill, an FP8 decode; a bf16
prefill, an fp32 decode).

The prefill worker keeps a shadow pool in the decode side's format; before each send, the
blocks about to leave are re-encoded into it and the sender reads from the shadow. Converting
on the sending side means an fp32 -> FP8 pair moves FP8 bytes over the link (about a quarter),
and it works for shm too, where the prefill writes straight into the decode worker's memory.
"""

from __future__ import annotations

import torch

from pdserve.model.kv_cache import LayerCache, layer_caches, row_size, storage_dtype


class WireSource:
    def __init__(
        self,
        caches: list[LayerCache],
        kv_cache_dtype: str,
        dtype: torch.dtype,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: this engine's model dtype; `wire_dtype`: the decode side's (default the
        same), the dtype of its full-precision KV."""
        self.caches, self.dtype, self.wire_dtype = caches, dtype, wire_dtype or dtype
        own = caches[0].blocks
        num_blocks, _, num_kv_heads, block_size, _ = own.shape
        row = row_size(caches[0].head_dim, kv_cache_dtype)
        shape = (len(caches), num_blocks, 2, num_kv_heads, block_size, row)
        kind = storage_dtype(kv_cache_dtype, self.wire_dtype)
        self.kv = torch.zeros(shape, dtype=kind, device=own.device)
        self.wire_caches = layer_caches(self.kv, kv_cache_dtype)

    def convert(self, layers: list[int], block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, device=self.kv.device)
        for layer in layers:
            src, dst = self.caches[layer], self.wire_caches[layer]
            values = src.decode(src.blocks.index_select(0, index), self.dtype)
            dst.blocks[index] = dst.encode(values.to(self.wire_dtype))
