"""Bandwidth caps: parsing "10Gbit"-style values and a thread-safe token bucket.

The cap emulates a slower link (to study transfer cost at 1/10/100 Gbit/s on one machine)
and keeps a prefill worker from starving others on a shared NIC. The sender paces in
chunks of at most 1 MiB, so a long transfer is smooth rather than one burst and one sleep.

The burst is 64 KiB, well under one layer of a request: a layer-wise transfer idles while
the next layer computes, so a bucket refilled to a larger burst (1 MiB held a whole
256-token SmolLM2 layer, 384 KiB) would let the last layer through unpaced and hide the
cap's cost in exactly the tail that layer-wise transfer measures (docs/transfer.md).
"""

from __future__ import annotations

import re
import threading
import time

BURST_BYTES = 64 << 10
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
