"""tcp data path (sender side): block runs as framed payloads over the peer connection.

Each coalesced run is one *write*; a write larger than a frame (at most ``chunk_bytes``,
1 MiB, and at most the staging buffers on either end) goes as several frames of whole
blocks, so every frame passes the receiver's ``nbytes == num_blocks * block_bytes`` check on
its own and fits one staging buffer. The receiver side lives in ``receiver.py``.
"""

from __future__ import annotations

import zlib

import torch

from pdserve.transfer import wire
from pdserve.transfer.base import BlockWriter, Run, WriteContext
from pdserve.transfer.buffers import block_bytes_view


class TcpWriter(BlockWriter):
    name = "tcp"

    def __init__(self, ctx: WriteContext) -> None:
        super().__init__(ctx)
        frame_bytes = min(ctx.chunk_bytes, ctx.max_frame_bytes)
        if ctx.staging is not None:
            frame_bytes = min(frame_bytes, ctx.staging.buffer_bytes)
        self.blocks_per_frame = max(1, frame_bytes // ctx.layout.block_bytes)
        self.checksum = True if ctx.checksum is None else ctx.checksum

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        ctx = self.ctx
        for layer in layers:
            for src_start, dst_start, num_blocks in runs:
                for offset in range(0, num_blocks, self.blocks_per_frame):
                    if ctx.stopped(request_id):
                        return
                    n = min(self.blocks_per_frame, num_blocks - offset)
                    src = block_bytes_view(ctx.kv, layer, src_start + offset, n)
                    if ctx.staging is None:
                        self._send(request_id, layer, dst_start + offset, n, src)
                    else:
                        with ctx.staging.borrow() as buf:
                            staged = buf[: src.numel()]
                            staged.copy_(src)
                            self._send(request_id, layer, dst_start + offset, n, staged)
                ctx.account(request_id, 1, 0, 0)

    def _send(
        self, request_id: str, layer: int, dst_start: int, num_blocks: int, data: torch.Tensor
    ) -> None:
        payload = memoryview(data.numpy())
        header = {
            "type": wire.DATA,
            "request_id": request_id,
            "layer": layer,
            "dst_start": dst_start,
            "num_blocks": num_blocks,
            "nbytes": len(payload),
        }
        if self.checksum:
            header["crc32"] = zlib.crc32(payload)
        if self.ctx.bucket is not None:
            self.ctx.bucket.consume(8 * len(payload))
        self.ctx.conn.send(header, payload)
        self.ctx.account(request_id, 0, 1, len(payload))
