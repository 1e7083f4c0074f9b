"""A worker's heap: the memory one step frees kept for the next.

Every step allocates its activations afresh and frees them at its end, and glibc's malloc
returns such blocks to the kernel (unmapped over its mmap threshold, trimmed off the heap's
top past its trim threshold): the next step takes a page fault and a zeroed page for every
4 KiB it writes, millions a minute on a 1B model (docs/cpu-kernels.md, "Memory a step
frees").

So an engine process raises both thresholds to the activations its memory plan already
counts (engine/memory.py: `activation_bytes`, the largest step's): blocks up to that size
come from the heap, and up to that much free memory stays in it. The process holds its
largest step's activations from then on, which the plan counted as its peak anyway; larger
blocks are still mapped and unmapped, and a heap's free top beyond it is still returned.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(nbytes: int) -> bool:
    """Blocks of up to `nbytes` come from the heap, and up to `nbytes` of freed memory stays
    in it (this process, from now on). False, logged, where the C library is not glibc."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    value = min(nbytes, 2**31 - 1)  # mallopt takes an int
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.warning("no mallopt in this C library: freed activations go back to the kernel")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, value)) and bool(mallopt(M_TRIM_THRESHOLD, value))
    if not ok:
        log.warning("mallopt refused %d bytes: freed activations go back to the kernel", value)
    return ok
