"""tcp data path (sender side): block runs as framed payloads over the peer connection.

Each coalesced run is one *write*; a write larger than a frame (at most 1 MiB and at most
the staging buffers on either end) goes as several frames of whole blocks, so every frame
passes the receiver's ``nbytes == num_blocks * block_bytes`` check on its own and fits one
staging buffer. The receiver side lives in ``receiver.py``.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch

from pdserve.transfer import protocol as P
from pdserve.transfer.peer import PeerConnection
from pdserve.transfer.receiver import block_bytes_view

if TYPE_CHECKING:
    from pdserve.transfer.send_state import SendState
    from pdserve.transfer.sender import SocketKVSender


class TcpPath:
    name = "tcp"

    def __init__(self, sender: SocketKVSender, conn: PeerConnection, max_frame_bytes: int) -> None:
        self.sender, self.conn = sender, conn
        block_bytes = sender.layout.block_bytes
        frame_bytes = min(sender.chunk_bytes, max_frame_bytes)
        if sender.pool is not None:
            frame_bytes = min(frame_bytes, sender.pool.buffer_bytes)
        self.blocks_per_frame = max(1, frame_bytes // block_bytes)
        self.checksum = True if sender.checksum is None else sender.checksum

    def write(self, state: SendState, layers: list[int], runs: list[tuple[int, int, int]]) -> None:
        s = self.sender
        for layer in layers:
            for src_start, dst_start, num_blocks in runs:
                for offset in range(0, num_blocks, self.blocks_per_frame):
                    if s.should_stop(state):
                        return
                    n = min(self.blocks_per_frame, num_blocks - offset)
                    src = block_bytes_view(s.kv, layer, src_start + offset, n)
                    if s.pool is None:
                        self._send(state, layer, dst_start + offset, n, src)
                    else:
                        with s.pool.borrow() as buf:
                            staged = buf[: src.numel()]
                            staged.copy_(src)
                            self._send(state, layer, dst_start + offset, n, staged)
                s.account(state, writes=1)

    def _send(
        self, state: SendState, layer: int, dst_start: int, num_blocks: int, data: torch.Tensor
    ) -> None:
        payload = memoryview(data.numpy())
        header = {
            "type": P.DATA,
            "request_id": state.request_id,
            "layer": layer,
            "dst_start": dst_start,
            "num_blocks": num_blocks,
            "nbytes": len(payload),
        }
        if self.checksum:
            header["crc32"] = zlib.crc32(payload)
        if self.sender.bucket is not None:
            self.sender.bucket.consume(8 * len(payload))
        self.conn.send(header, payload)
        self.sender.account(state, frames=1, nbytes=len(payload))
