"""Sender-side bookkeeping: per-request state, queued jobs, and ``send()`` argument checks.

Checks that catch caller bugs run in the caller's thread and raise ValueError at once;
everything that depends on the network or the receiver is reported later as FAILED.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.transfer import protocol as P
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout

if TYPE_CHECKING:
    from pdserve.transfer.peer import PeerConnection
    from pdserve.transfer.sender import SocketKVSender


@dataclass(eq=False)
class SendState:
    request_id: str
    peer_key: tuple[str, int]
    status: TransferStatus = TransferStatus.WAITING
    error: str | None = None
    pending: int = 0  # queued or running jobs; source blocks are read until this is 0
    last_sent: bool = False
    reported: bool = False
    conn: PeerConnection | None = None
    num_writes: int = 0
    num_frames: int = 0
    bytes_sent: int = 0
    fault: Any = None  # test-only (transfer/faults.py): claimed on the request's first job

    def counts(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "num_writes": self.num_writes,
            "num_frames": self.num_frames,
            "bytes_sent": self.bytes_sent,
        }


@dataclass
class Job:
    state: SendState | None
    layers: list[int]
    runs: list[tuple[int, int, int]]  # (src_start, dst_start, num_blocks)
    last: bool
    abort_request_id: str | None = None


@dataclass
class PeerInfo:
    """What the sender needs from a receiver's ``address()``, checked once."""

    key: tuple[str, int]
    backends: list[str]
    use_shm: bool
    shm_name: str | None
    max_frame_bytes: int
    layout: KVLayout  # the receiver's (its pool size may differ from ours)


def parse_peer(peer: dict[str, Any], layout: KVLayout, backend: str) -> PeerInfo:
    """Check a receiver address against our layout and backend; pick shm or tcp."""
    if not isinstance(peer, dict):
        raise ValueError(f"peer must be a receiver address dict, got {type(peer).__name__}")
    missing = [k for k in ("backends", "host", "port", "layout") if k not in peer]
    if missing:
        raise ValueError(f"peer address lacks {missing}; pass KVReceiver.address()")
    peer_layout = KVLayout.from_dict(peer["layout"])
    if peer_layout.block_format() != layout.block_format():
        raise ValueError(f"KV layout mismatch: sender {layout.to_dict()}, peer {peer['layout']}")
    backends = list(peer["backends"])
    same_host = peer.get("host_id") == P.host_identity()
    shm_ok = "shm" in backends and same_host and bool(peer.get("shm_name"))
    if backend == "shm" and not shm_ok:
        why = "does not offer shm" if "shm" not in backends else "is on another host"
        raise ValueError(f"backend 'shm' requested but the receiver {why}")
    if backend == "tcp" and "tcp" not in backends:
        raise ValueError(f"backend 'tcp' requested but the receiver offers only {backends}")
    if backend == "auto" and not shm_ok and "tcp" not in backends:
        raise ValueError(f"no common backend: receiver offers {backends} on another host")
    return PeerInfo(
        key=(str(peer["host"]), int(peer["port"])),
        backends=backends,
        use_shm=shm_ok and backend != "tcp",
        shm_name=peer.get("shm_name"),
        max_frame_bytes=int(peer.get("max_frame_bytes") or layout.block_bytes),
        layout=peer_layout,
    )


def _check_ids(name: str, ids: list[int], limit: int) -> None:
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < limit:
            raise ValueError(f"{name} contains {i!r}, outside 0..{limit - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} contains duplicates: {ids}")


def validate_send(
    sender: SocketKVSender,
    peer: dict[str, Any],
    request_id: str,
    layers: list[int],
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> PeerInfo:
    layout = sender.layout
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
            "must have the same length"
        )
    _check_ids("layers", list(layers), layout.num_layers)
    _check_ids("src_block_ids", list(src_block_ids), layout.num_blocks)
    info = parse_peer(peer, layout, sender.backend)
    _check_ids("dst_block_ids", list(dst_block_ids), info.layout.num_blocks)
    return info
