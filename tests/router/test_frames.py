import asyncio

import pytest
import zmq

from pdserve.router.frames import FRAMES_PER_CALLBACK, FrameReader


@pytest.fixture
def pair():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def test_reads_every_frame_in_order_including_those_queued_before_start(pair):
    pull, push = pair
    n = 3 * FRAMES_PER_CALLBACK + 7  # more than one callback's share, with a remainder
    got: list[bytes] = []

    async def main():
        for i in range(10):  # queued before the reader exists: no edge will announce them
            push.send(b"early-%d" % i)
        await asyncio.sleep(0.05)
        reader = FrameReader(pull, got.append)
        reader.start()
        await _until(lambda: len(got) == 10)
        for i in range(n):
            push.send(b"%d" % i)
        await _until(lambda: len(got) == 10 + n)
        reader.stop()

    asyncio.run(main())
    assert got == [b"early-%d" % i for i in range(10)] + [b"%d" % i for i in range(n)]


def test_a_frame_whose_handler_raises_does_not_stop_the_next(pair):
    pull, push = pair
    got: list[bytes] = []

    def on_frame(frame: bytes) -> None:
        if frame == b"bad":
            raise RuntimeError("boom")
        got.append(frame)

    async def main():
        reader = FrameReader(pull, on_frame)
        reader.start()
        for frame in (b"a", b"bad", b"b"):
            push.send(frame)
        await _until(lambda: len(got) == 2)
        reader.stop()

    asyncio.run(main())
    assert got == [b"a", b"b"]


def test_nothing_is_read_after_stop(pair):
    pull, push = pair
    got: list[bytes] = []

    async def main():
        reader = FrameReader(pull, got.append)
        reader.start()
        push.send(b"before")
        await _until(lambda: got == [b"before"])
        reader.stop()
        push.send(b"after")
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert got == [b"before"]
    assert pull.recv(zmq.NOBLOCK) == b"after"  # still queued on the socket, not lost


class _CountingSocket:
    """A socket that counts its recv calls and the zmq.Again they raise."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket, self.recvs, self.agains = socket, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.socket, name)

    def recv(self, flags: int = 0) -> bytes:
        self.recvs += 1
        try:
            return self.socket.recv(flags)
        except zmq.Again:
            self.agains += 1
            raise


def test_a_wake_up_reads_its_frames_without_a_recv_that_finds_none(pair):
    # At batch 1 every token is a wake-up of its own: a recv too many per wake-up raised (and
    # built) a zmq.Again per token.
    pull, push = pair
    counting, got = _CountingSocket(pull), []

    async def main():
        reader = FrameReader(counting, got.append)
        reader.start()
        for i in range(20):
            push.send(b"%d" % i)
            await _until(lambda n=i + 1: len(got) == n)
        reader.stop()

    asyncio.run(main())
    assert got == [b"%d" % i for i in range(20)]
    assert (counting.recvs, counting.agains) == (20, 0)
