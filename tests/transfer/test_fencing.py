"""Fencing shm writers (receiver.py): a lease ends only on proof that its writer stopped,
its lease_end or its process's exit; until then a released reservation's blocks are fenced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from pdserve.transfer.base import TransferStatus
from tests.transfer.conftest import LAYOUT, Pair, assert_status, wait_finished


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _leased(pair: Pair, request_id: str) -> bool:
    req = pair.rx.table.get(request_id)
    return req is not None and req.active_leases > 0


def test_release_stops_a_slow_writer_at_its_next_chunk() -> None:
    """A paced writer (seconds for the whole send) is told and stops within a chunk, so
    release proves it done at once and the blocks need no fence."""
    pair = Pair("shm", tx_opts={"bandwidth_bps": "1Mbit"})
    try:
        ids = list(range(LAYOUT.num_blocks))
        pair.rx.expect("r", ids)
        pair.tx.send(pair.peer, "r", [0, 1, 2, 3], ids, ids, last=True)  # 4 x 64 KiB: 2 s
        _until(lambda: _leased(pair, "r"))
        started = time.monotonic()
        assert pair.rx.release("r") is True
        assert time.monotonic() - started < 0.9  # at most one 64 KiB chunk: 0.5 s
        assert pair.rx.pop_unfenced() == [] and pair.rx.stats()["num_fenced"] == 0
        assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.FAILED, "released")
        assert pair.rx_kv[3].equal(pair.initial[3])  # the last layer was never written
    finally:
        pair.close()


# A sender process whose writer freezes after its lease is granted; on "drop" it closes its
# connection while the frozen thread still has the pool mapped.
FROZEN = textwrap.dedent(
    """
    import socket, sys, threading, json
    from pdserve.transfer import shm
    from pdserve.transfer import make_sender
    from pdserve.transfer.sender import open_writer
    from tests.transfer.conftest import LAYOUT, SECRET, random_kv

    peer = json.loads(sys.argv[1])
    frozen = threading.Event()

    class Frozen:
        def consume(self, bits):
            frozen.set()
            threading.Event().wait()  # forever

    def make_writer(ctx):
        from dataclasses import replace
        return open_writer(replace(ctx, bucket=Frozen()))

    tx = make_sender("shm", random_kv(), LAYOUT, SECRET, make_writer=make_writer)
    tx.send(peer, "r", [0], [0, 1], [0, 1], last=True)
    frozen.wait()
    print("frozen", flush=True)
    sys.stdin.readline()
    for worker in tx._peers.values():
        worker.conn.sock.shutdown(socket.SHUT_RDWR)
    print("dropped", flush=True)
    sys.stdin.readline()
    """
)


def test_fence_outlives_the_connection_and_ends_with_the_process(monkeypatch) -> None:
    import json

    from pdserve.transfer import receiver

    monkeypatch.setattr(receiver, "RELEASE_WAIT_S", 0.2)
    pair = Pair("shm")
    proc = subprocess.Popen(
        [sys.executable, "-c", FROZEN, json.dumps(pair.peer)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pair.rx.expect("r", [0, 1])
        assert proc.stdout.readline().strip() == "frozen"
        assert pair.rx.release("r") is False  # the frozen writer never ends its lease
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "dropped"
        _until(lambda: pair.rx.stats()["num_orphans"] == 1)
        time.sleep(0.2)
        assert pair.rx.pop_unfenced() == []  # connection gone, writer process alive: fenced
        proc.kill()
        proc.wait()
        unfenced: list[str] = []
        _until(lambda: unfenced.extend(pair.rx.pop_unfenced()) or unfenced == ["r"])
        assert pair.rx.stats()["num_fenced"] == 0 and pair.rx.stats()["num_orphans"] == 0
    finally:
        proc.kill()
        proc.wait()
        pair.close()
