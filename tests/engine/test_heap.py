"""keep_freed_memory: a block a step frees is written again without page faults."""

import subprocess
import sys

import pytest

from pdserve.engine.heap import keep_freed_memory

# In a fresh interpreter (the setting is process-wide): 64 MiB allocated, written and freed
# twice; prints the page faults of the second round.
ROUNDS = """
import ctypes, resource, sys
from pdserve.engine.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory(256 << 20)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""


def second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_freed_block_is_written_again_without_faults():
    pages = (64 << 20) // 4096
    assert second_round_faults("default") > pages // 2  # glibc unmapped it on free
    assert second_round_faults("keep") < pages // 100


def test_nbytes_must_be_positive():
    with pytest.raises(ValueError, match="nbytes"):
        keep_freed_memory(0)
