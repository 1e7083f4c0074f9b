"""KV bytes on either end: uint8 views of block runs, and a bounded pool of staging buffers.

Staging is needed where bytes cannot go straight between KV pools: tcp receive (bytes are
checked in a buffer before any reaches KV memory) and tcp send from a pool outside host
memory (a device -> host copy first). A transfer that finds no free buffer waits for one
instead of allocating, so a burst of requests slows down rather than exhausting host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DEFAULT_BUFFER_BYTES = 1 << 20
DEFAULT_POOL_BYTES = 64 << 20


def block_bytes_view(kv: torch.Tensor, layer: int, start: int, num_blocks: int) -> torch.Tensor:
    """The bytes of blocks ``start..start+num_blocks-1`` of ``layer``, as a uint8 view: one
    contiguous range because ``kv`` is contiguous (see the diagram in ``layout.py``)."""
    return kv[layer, start : start + num_blocks].reshape(-1).view(torch.uint8)


class BufferPool:
    """``num_buffers`` uint8 tensors of ``buffer_bytes`` each, allocated once."""

    def __init__(
        self,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        pin_memory: bool = False,
    ) -> None:
        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
        if pool_bytes < buffer_bytes:
            raise ValueError(
                f"pool_bytes ({pool_bytes}) must hold at least one buffer of {buffer_bytes}"
            )
        self.buffer_bytes = buffer_bytes
        self.num_buffers = pool_bytes // buffer_bytes
        self._free = [
            torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin_memory)
            for _ in range(self.num_buffers)
        ]
        self._cond = threading.Condition()
        self._in_use = 0
        self.max_in_use = 0
        self.num_waits = 0

    def acquire(self, timeout_s: float | None = None) -> torch.Tensor:
        """A free buffer, waiting for one if all are in use; TimeoutError after timeout_s."""
        with self._cond:
            if not self._free:
                self.num_waits += 1
                if not self._cond.wait_for(lambda: bool(self._free), timeout_s):
                    raise TimeoutError(f"no staging buffer free within {timeout_s} s")
            self._in_use += 1
            self.max_in_use = max(self.max_in_use, self._in_use)
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._in_use -= 1
            self._cond.notify()

    @contextmanager
    def borrow(self, timeout_s: float | None = None) -> Iterator[torch.Tensor]:
        buf = self.acquire(timeout_s)
        try:
            yield buf
        finally:
            self.release(buf)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "num_buffers": self.num_buffers,
                "buffer_bytes": self.buffer_bytes,
                "in_use": self._in_use,
                "max_in_use": self.max_in_use,
                "num_waits": self.num_waits,
            }
