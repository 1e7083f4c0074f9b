"""The KV pool layout both ends of a transfer must agree on, and block-run arithmetic.

One worker holds one KV tensor of shape ``(num_layers, num_blocks, 2, num_kv_heads,
block_size, head_dim)``, contiguous. ``kv[l, b]`` (K then V of block ``b`` in layer ``l``)
is one contiguous range of ``block_bytes``, so consecutive block ids within a layer are one
contiguous byte range::

    kv[l] = | b0: K V | b1: K V | b2: K V | ...     a run b1..b2 = 2 * block_bytes, one copy

This module is torch-free at import, so control-plane code can check layouts without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of a worker's KV pool; sender and receiver must hold equal layouts."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_layers,
            self.num_blocks,
            2,
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
        )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def block_format(self) -> dict[str, Any]:
        """What must agree between a sender and a receiver: everything but the pool size,
        which is each worker's own memory budget (block ids are checked per side)."""
        return {k: v for k, v in asdict(self).items() if k != "num_blocks"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        if not isinstance(data, dict):
            raise ValueError(f"KVLayout.from_dict expects a dict, got {type(data).__name__}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"bad KVLayout dict {data!r}: {e}") from e

    @classmethod
    def from_tensor(cls, kv: Any) -> KVLayout:
        """The layout of a torch KV tensor (dtype name without the ``torch.`` prefix)."""
        num_layers, num_blocks, two, num_kv_heads, block_size, head_dim = kv.shape
        if two != 2:
            raise ValueError(f"kv dim 2 must be 2 (K and V), got shape {tuple(kv.shape)}")
        return cls(
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            str(kv.dtype).removeprefix("torch."),
        )


def check_kv_tensor(kv: Any, layout: KVLayout) -> None:
    """Raise ValueError unless ``kv`` is a contiguous tensor matching ``layout``."""
    if tuple(kv.shape) != layout.shape:
        raise ValueError(f"kv shape {tuple(kv.shape)} does not match layout {layout.shape}")
    if str(kv.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kv dtype {kv.dtype} does not match layout dtype {layout.dtype}")
    if not kv.is_contiguous():
        raise ValueError("kv must be contiguous: block runs are copied as byte ranges")


def check_ids(name: str, ids: list[int], limit: int) -> None:
    """ValueError unless ``ids`` are distinct ints in ``0..limit-1`` (layers or block ids)."""
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < limit:
            raise ValueError(f"{name} contains {i!r}, outside 0..{limit - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} contains duplicates: {ids}")


def coalesce_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Group (src, dst) block pairs into runs ``(src_start, dst_start, num_blocks)``.

    A run grows while both ids are consecutive, so it is one contiguous range on both sides
    and moves as one write. Pairs are independent, so they are sorted by source id first:
    a block table listed out of order still coalesces.
    """
    pairs = sorted(zip(src_block_ids, dst_block_ids, strict=True))
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            src_start, dst_start, n = runs[-1]
            if src == src_start + n and dst == dst_start + n:
                runs[-1] = (src_start, dst_start, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def block_bytes_view(kv: Any, layer: int, start: int, num_blocks: int) -> Any:
    """The bytes of blocks ``start..start+num_blocks-1`` of ``layer``, as a uint8 view: one
    contiguous range because ``kv`` is contiguous (the diagram above)."""
    import torch

    return kv[layer, start : start + num_blocks].reshape(-1).view(torch.uint8)
