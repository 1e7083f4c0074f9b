import subprocess
import sys

from pdserve.kvcache.hashing import hash_block, hash_blocks, root_hash


def test_chained_hashes_cover_only_full_blocks():
    root = root_hash("m")
    hashes = hash_blocks(list(range(10)), 4, root)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(root, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Resuming from a later block gives the same tail.
    assert hash_blocks(list(range(10)), 4, hashes[0], start_block=1) == hashes[1:]


def test_hash_depends_on_parent_and_model():
    assert hash_block(1, [1, 2]) != hash_block(2, [1, 2])
    assert root_hash("a") != root_hash("b")
    assert root_hash("a") != root_hash("a", extra_key="fp8")


def test_stable_across_processes():
    code = "from pdserve.kvcache.hashing import *; print(hash_blocks([5]*8, 4, root_hash('x')))"
    runs = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert len(runs) == 1
    assert runs.pop().strip() == str(hash_blocks([5] * 8, 4, root_hash("x")))
