"""The contract of the KV tiers below a worker's own pool (L2 host DRAM, L3 disk, L4 Redis)
and the entry format they store (docs/tiers.md, "Entry format" and "Authentication").

A tier stores *entries*: one KV block in every layer (``kv[:, b]``), keyed by its chained
block hash (`pdserve.kvcache.hashing`), behind a header whose HMAC-SHA256 under the
``EntryFormat``'s key lets a reader trust nothing it cannot verify (a shared directory or
Redis is writable by others). Sizes are checked before anything is copied: a payload that is
not exactly one block of the format is corrupt, so a crafted size cannot reach the engine.

The contract every tier keeps: operational problems (tier down, disk full, corrupt or foreign
entry, too-big payload) never raise; `get` turns them into a miss (None) and `put` into False,
and `stats()` counts them. Only programming errors (wrong argument types) raise.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from pdserve.transfer.layout import KVLayout

MAGIC = b"PDKV"
FORMAT_VERSION = 2
HEADER = struct.Struct("<4sHHQQ32s")  # magic, version, desc_len, hash, payload_len, mac
_MACED = struct.Struct("<4sHHQQ")  # the header fields the MAC covers
MIN_KEY_BYTES = 16
_U64_MASK = (1 << 64) - 1

Payload = bytes | bytearray | memoryview
# Called with (block_hash, payload) for each entry a tier evicted, after its lock is released.
EvictCallback = Callable[[int, bytes], None]


class EntryError(Exception):
    """An entry that must be treated as a miss; `kind` is "corrupt" or "foreign"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind} entry: {reason}")
        self.kind = kind


@dataclass(frozen=True)
class EntryFormat:
    """What a reader expects an entry to be; two workers share entries only if these match.

    `num_blocks` of the KVLayout is left out on purpose: it is the size of one worker's pool,
    not a property of a block. 8-bit pools need no tag: their `dtype` and `head_dim` (the row
    width, scale included) already differ (docs/tiers.md).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str
    key: bytes = field(default=b"", repr=False)  # the MAC key; tiers refuse an empty one

    @classmethod
    def from_layout(cls, model_id: str, layout: KVLayout) -> EntryFormat:
        return cls(
            model_id,
            layout.num_layers,
            layout.num_kv_heads,
            layout.block_size,
            layout.head_dim,
            layout.dtype,
        )

    @property
    def descriptor(self) -> bytes:
        return (
            f"model={self.model_id};layers={self.num_layers};kv_heads={self.num_kv_heads};"
            f"block_size={self.block_size};head_dim={self.head_dim};dtype={self.dtype}"
        ).encode()

    @property
    def namespace(self) -> str:
        """Readable and unique per format: the model id made path/key safe + a digest, so a
        directory or Redis key prefix never mixes formats (and `ls` still says whose it is)."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model_id).strip("_")[-48:] or "model"
        return f"{safe}-{hashlib.blake2b(self.descriptor, digest_size=4).hexdigest()}"

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block in every layer: the only payload size an entry may have."""
        one_block = KVLayout(
            self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        return one_block.total_bytes

    @property
    def entry_bytes(self) -> int:
        """Stored size of every entry of this format."""
        return HEADER.size + len(self.descriptor) + self.payload_bytes

    def _mac(self, fixed: bytes, desc: bytes, payload: Payload) -> bytes:
        mac = hmac.new(self.key, fixed, hashlib.sha256)
        mac.update(desc)
        mac.update(payload)
        return mac.digest()

    def encode_header(self, block_hash: int, payload: Payload) -> bytes:
        """Header + descriptor; the payload follows it unchanged (so it can be written from
        the caller's buffer without a concatenation copy)."""
        desc = self.descriptor
        payload_len = memoryview(payload).nbytes
        fixed = _MACED.pack(MAGIC, FORMAT_VERSION, len(desc), block_hash & _U64_MASK, payload_len)
        return fixed + self._mac(fixed, desc, payload) + desc

    def encode(self, block_hash: int, payload: Payload) -> bytes:
        return self.encode_header(block_hash, payload) + bytes(payload)

    def decode(self, block_hash: int, data: Payload) -> bytes:
        """The payload of a stored entry, or EntryError when it must be a miss."""
        view = memoryview(data).cast("B")
        if len(view) < HEADER.size:
            raise EntryError("corrupt", f"{len(view)} bytes is shorter than the header")
        magic, version, desc_len, stored_hash, payload_len, mac = HEADER.unpack_from(view)
        if magic != MAGIC:
            raise EntryError("corrupt", f"bad magic {magic!r}")
        if version != FORMAT_VERSION:
            raise EntryError("foreign", f"format version {version}, expected {FORMAT_VERSION}")
        desc = bytes(view[HEADER.size : HEADER.size + desc_len])
        if desc != self.descriptor:
            raise EntryError("foreign", f"descriptor {desc!r}")
        if stored_hash != block_hash & _U64_MASK:
            raise EntryError("corrupt", f"entry of hash {stored_hash:#x} under {block_hash:#x}")
        if payload_len != self.payload_bytes:
            raise EntryError(
                "corrupt", f"payload {payload_len} bytes, a block is {self.payload_bytes}"
            )
        start = HEADER.size + desc_len
        if len(view) - start != payload_len:
            raise EntryError("corrupt", f"payload {len(view) - start} bytes, header {payload_len}")
        payload = view[start:]
        fixed = view[: _MACED.size]
        if not hmac.compare_digest(self._mac(fixed, desc, payload), mac):
            raise EntryError("corrupt", "MAC mismatch (tampered, damaged, or another key)")
        return bytes(payload)


@dataclass
class TierStats:
    """Counters of one tier; `corrupt` and `foreign` entries are also counted as misses."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    foreign: int = 0
    puts: int = 0
    rejected_puts: int = 0  # put returned False: too big, tier down, write failed
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    errors: int = 0  # operational failures (I/O, network), each degraded to a miss/False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            snap = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}
        lookups = snap["hits"] + snap["misses"]
        snap["hit_rate"] = snap["hits"] / lookups if lookups else 0.0
        return snap


class KVTier(ABC):
    """One tier of block storage; thread-safe, and keeps the never-raise contract above.

    A tier holds at most `capacity_bytes` of entries (header included), evicting least
    recently used ones, each passed to `on_evict` (a TieredStore's write-down). A tier whose
    capacity is managed elsewhere (Redis' maxmemory) has `capacity_bytes == 0`.
    """

    name: str
    capacity_bytes: int

    def __init__(self, name: str, fmt: EntryFormat, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        if len(fmt.key) < MIN_KEY_BYTES:
            raise ValueError(
                f"{name}: the entry format needs a MAC key of >= {MIN_KEY_BYTES} bytes"
            )
        self.name = name
        self.fmt = fmt
        self.capacity_bytes = capacity_bytes
        self.on_evict: EvictCallback | None = None
        self._stats = TierStats()

    @abstractmethod
    def put(self, block_hash: int, payload: Payload) -> bool:
        """Store a block; True once stored (or already present). The payload is not kept
        by reference: the caller may reuse its buffer when put returns."""

    @abstractmethod
    def get(self, block_hash: int) -> bytes | None:
        """The payload, or None on a miss, a corrupt/foreign entry or a tier that is down."""

    @abstractmethod
    def contains(self, block_hash: int) -> bool:
        """Cheap presence check without reading or verifying the entry; approximate (a get
        may still miss), and remote tiers may answer False when down."""

    @abstractmethod
    def delete(self, block_hash: int) -> bool:
        """Remove an entry; True when one was removed."""

    def _decode(self, block_hash: int, data: Payload) -> bytes | None:
        """The payload, counted as a hit; or None, counted as a miss. A corrupt entry is
        deleted; a foreign one is valid for its writer and stays."""
        try:
            payload = self.fmt.decode(block_hash, data)
        except EntryError as e:
            self._stats.add(misses=1, **{e.kind: 1})
            if e.kind == "corrupt":
                self.delete(block_hash)
            return None
        self._stats.add(hits=1, bytes_read=len(payload))
        return payload

    def stats(self) -> dict[str, int | float | str]:
        return {"name": self.name, "capacity_bytes": self.capacity_bytes, **self._stats.snapshot()}

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release connections/handles; stored entries stay for other processes."""
