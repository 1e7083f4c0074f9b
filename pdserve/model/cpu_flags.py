"""What this CPU runs, from /proc/cpuinfo. Torch-free: the launcher reads it to resolve a
role's `dtype: auto`, the native kernels to pick their variant."""

from __future__ import annotations

import functools
from pathlib import Path

# Units that make torch's bf16 matmul fast on x86 (oneDNN: AMX tiles, else AVX512_BF16 dot
# products); without them bf16 is computed through fp32 conversions, slower than fp32.
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo (empty where it is unreadable, e.g. not Linux)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def has_fast_bf16() -> bool:
    return any(f in cpu_flags() for f in BF16_MATMUL_FLAGS)
