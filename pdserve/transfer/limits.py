"""What bounds a transfer: a bandwidth cap ("10Gbit", a token bucket) and staging memory.

The cap emulates a slower link and keeps a prefill worker from starving others on a shared
NIC. The sender paces in chunks of at most 1 MiB, and the burst is 64 KiB, well under one
layer of a request: a larger burst would let a layer-wise transfer's last layer through
unpaced and hide the cap's cost in exactly the tail it measures (docs/transfer.md).

Staging buffers hold tcp payloads on receive (checked before any byte reaches KV memory) and,
on send, bytes of a pool outside host memory. A transfer that finds no free buffer waits for
one, so a burst of requests slows down rather than exhausting host memory. Torch-free at
import (the control plane parses bandwidths); the pool loads torch.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BURST_BYTES = 64 << 10
DEFAULT_BUFFER_BYTES = 1 << 20
DEFAULT_POOL_BYTES = 64 << 20
_PREFIX = {"G": 1e9, "M": 1e6, "K": 1e3, "k": 1e3, "g": 1e9, "m": 1e6, "": 1.0}
_PATTERN = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([GMKgmk]?)(bit|bps|B)(?:/s)?\s*$"
)


def parse_bandwidth(value: str | float | int | None) -> float | None:
    """Bits per second from "10Gbit", "100Mbps", "1.5GB" (bytes/s), ...; None stays None.

    Numbers are taken as bits/s; strings need a unit, since "10" alone is ambiguous. Units
    are decimal (1 Gbit = 1e9 bit), like link speeds; a capital B means bytes.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bps = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise ValueError(
                f"invalid bandwidth {value!r}: expected a number and a unit "
                "(Gbit, Mbit, Kbit or Gbps... for bits/s; GB, MB, KB for bytes/s), e.g. '10Gbit'"
            )
        number, prefix, unit = match.groups()
        bps = float(number) * _PREFIX[prefix] * (8.0 if unit == "B" else 1.0)
    else:
        raise ValueError(f"invalid bandwidth {value!r}: expected a string like '10Gbit'")
    if not bps > 0:
        raise ValueError(f"bandwidth must be positive, got {value!r}")
    return bps


class TokenBucket:
    """Tokens are bits, refilled at ``rate_bps`` up to ``burst_bits``.

    ``consume`` takes the tokens at once (going into debt) and then sleeps off the debt
    outside the lock, so concurrent callers queue fairly and the long-run rate never
    exceeds ``rate_bps``. The bucket starts empty: N bits take at least
    (N - burst_bits) / rate seconds even after an idle period.
    """

    def __init__(self, rate_bps: float, burst_bits: float = 8 * BURST_BYTES) -> None:
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be positive, got {rate_bps}")
        self.rate_bps = float(rate_bps)
        self.burst_bits = float(burst_bits)
        self._tokens = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, bits: float) -> float:
        """Take ``bits`` tokens, sleeping as long as needed; returns seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst_bits, self._tokens + (now - self._last) * self.rate_bps)
            self._last = now
            self._tokens -= bits
            wait_s = -self._tokens / self.rate_bps if self._tokens < 0 else 0.0
        if wait_s > 0:
            time.sleep(wait_s)
        return wait_s


class BufferPool:
    """``num_buffers`` uint8 tensors of ``buffer_bytes`` each, allocated once. A buffer holds
    at least ``block_bytes`` (frames carry whole blocks), the pool at least one buffer."""

    def __init__(
        self,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        block_bytes: int = 1,
    ) -> None:
        import torch

        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
        self.buffer_bytes = max(buffer_bytes, block_bytes)
        self.num_buffers = max(pool_bytes // self.buffer_bytes, 1)
        self._free = [
            torch.empty(self.buffer_bytes, dtype=torch.uint8) for _ in range(self.num_buffers)
        ]
        self._cond = threading.Condition()
        self._in_use = 0
        self.max_in_use = 0
        self.num_waits = 0

    def acquire(self, timeout_s: float | None = None) -> Any:
        """A free buffer, waiting for one if all are in use; TimeoutError after timeout_s."""
        with self._cond:
            if not self._free:
                self.num_waits += 1
                if not self._cond.wait_for(lambda: bool(self._free), timeout_s):
                    raise TimeoutError(f"no staging buffer free within {timeout_s} s")
            self._in_use += 1
            self.max_in_use = max(self.max_in_use, self._in_use)
            return self._free.pop()

    def release(self, buf: Any) -> None:
        with self._cond:
            self._free.append(buf)
            self._in_use -= 1
            self._cond.notify()

    @contextmanager
    def borrow(self, timeout_s: float | None = None) -> Iterator[Any]:
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
