"""The frames of a ZMQ socket, read by a callback of the event loop.

pyzmq's asyncio sockets make a Future, register and unregister a reader and wake a task for
every frame, and at batch 1 each token is a frame of its own. Here the socket's file
descriptor wakes one callback that hands over every frame queued, in order: the router's CPU
per streamed token fell from 0.71 to 0.59 ms (BENCHMARKS.md §11), and on a host whose cores
the worker's threads use, that CPU is taken from them (docs/cpu-kernels.md, "Serving").

ZMQ's descriptor is edge-triggered: it signals that the socket's state changed, not that a
frame waits, so a wake-up must read until the socket has none, or later frames would sit
unread until the next one arrives. Whether one waits is asked of `ZMQ_EVENTS` (which also
re-arms the descriptor), not learnt from a `zmq.Again` raised by one recv too many: at batch
1 that exception, built once per token, held the GIL in 6% of py-spy's samples of the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

FRAMES_PER_CALLBACK = 256  # then other callbacks (HTTP writes) run before the rest is read


class FrameReader:
    """Calls `on_frame(frame)` for each frame `socket` receives, on the running loop, from
    `start()` until `stop()`. An exception of `on_frame` is logged; reading goes on."""

    def __init__(self, socket: zmq.Socket, on_frame: Callable[[bytes], None]) -> None:
        self.socket, self.on_frame = socket, on_frame
        self._fd = socket.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # what arrived before the reader was added

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _drain(self) -> None:
        if self._loop is None:  # stopped while a call_soon was pending
            return
        socket = self.socket
        for _ in range(FRAMES_PER_CALLBACK):
            if not socket.get(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:  # EVENTS said a frame waits; should not happen
                return
            try:
                self.on_frame(frame)
            except Exception:  # one bad frame must not stop the reading of the next
                log.exception("error handling a frame of %d bytes", len(frame))
        self._loop.call_soon(self._drain)  # more may be queued, and no edge will say so
