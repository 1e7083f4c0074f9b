"""A worker's heap: the memory one step frees kept for the next.

Every step allocates its activations afresh (each linear's output, the MLP's gate/up, the
logits) and frees them at its end. glibc's malloc returns them to the kernel: a block over
its mmap threshold (128 KiB, rising to at most 32 MiB as blocks are freed) is unmapped on
free, and a heap whose free top passes the trim threshold is shrunk. The next step then
takes a page fault, and a page zeroed by the kernel, for every 4 KiB it writes. On a 1B
Llama (Q4_K_M, 2 threads, 32 requests of 128 prompt tokens and 32 output tokens, offline)
that was 2.6-4.2 million faults and 7-11 s of system time in a 40 s run; kept, 0.3 million
and 1.1 s (the faults left are the model's file pages), and a 512-token prefill took
~10% less time (docs/cpu-kernels.md, "Memory a step frees").

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
