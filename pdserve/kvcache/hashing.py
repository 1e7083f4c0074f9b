"""Stable block hashes for the prefix cache.

A full block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes. The hash must be identical in every process (router and workers compute the same
values to route by cache affinity), hence blake2b rather than Python's salted `hash`.

    root = H(model_id)     h0 = H(root, t0..t15)     h1 = H(h0, t16..t31)   ...
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

_U64 = struct.Struct("<Q")


def root_hash(model_id: str, extra_key: str = "") -> int:
    """The parent hash of a sequence's first block: scopes hashes to a model (and, e.g., a
    KV dtype), so blocks of different models never match."""
    digest = hashlib.blake2b(f"{model_id}\0{extra_key}".encode(), digest_size=8).digest()
    return _U64.unpack(digest)[0]


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = _U64.pack(parent_hash) + array("q", token_ids).tobytes()
    return _U64.unpack(hashlib.blake2b(payload, digest_size=8).digest())[0]


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int, start_block: int = 0
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on; `parent_hash` is
    the hash of block `start_block - 1` (or the root). A partial last block has no hash."""
    hashes = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[begin : begin + block_size])
        hashes.append(parent_hash)
    return hashes
