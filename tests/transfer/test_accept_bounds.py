"""The receiver's listener stays bounded and alive whatever unauthenticated peers do."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

from pdserve.transfer import wire as P
from pdserve.transfer.base import TransferStatus
from tests.transfer.conftest import Pair, assert_status, wait_finished


def _conn_threads(port: int) -> int:
    return sum(t.name == f"kv-rx-conn-{port}" for t in threading.enumerate())


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _transfer_ok(pair: Pair, request_id: str) -> None:
    pair.rx.expect(request_id, [1, 2])
    pair.tx.send(pair.peer, request_id, [0, 1, 2, 3], [5, 6], [1, 2], last=True)
    assert_status(wait_finished(pair.tx, [request_id]), request_id, TransferStatus.DONE)


def test_silent_connections_cannot_grow_threads_or_lock_out_for_good() -> None:
    """200 peers that connect and never authenticate hold at most MAX_HANDSHAKES threads;
    the rest are closed on accept, and once they go a real sender is served."""
    pair = Pair("tcp")
    port = pair.peer["port"]
    silent = []
    try:
        for _ in range(200):
            silent.append(socket.create_connection(("127.0.0.1", port)))
        _wait_for(lambda: pair.rx.stats()["rejected_busy"] >= 200 - P.FrameServer.MAX_HANDSHAKES)
        assert _conn_threads(port) <= P.FrameServer.MAX_HANDSHAKES
        for sock in silent:
            sock.close()
        _wait_for(lambda: _conn_threads(port) == 0)
        _transfer_ok(pair, "after-flood")
        pair.assert_landed([0, 1, 2, 3], [5, 6], [1, 2])
    finally:
        for sock in silent:
            sock.close()
        pair.close()


# In its own process: it lowers the descriptor limit until accept() fails with EMFILE.
EMFILE = textwrap.dedent(
    """
    import errno, os, resource, socket, time
    from pdserve.transfer.base import TransferStatus
    from tests.transfer.conftest import Pair, wait_finished
    pair = Pair("tcp")
    port = pair.peer["port"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    fillers = []
    try:
        while True:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        assert e.errno == errno.EMFILE, e
    os.close(fillers.pop())  # room for one client socket, none for accept()
    client = socket.create_connection(("127.0.0.1", port), timeout=1)
    time.sleep(0.5)  # the accept loop meets EMFILE meanwhile
    for fd in fillers:
        os.close(fd)
    client.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    pair.rx.expect("r", [1, 2])
    pair.tx.send(pair.peer, "r", [0, 1], [5, 6], [1, 2], last=True)
    print(wait_finished(pair.tx, ["r"])["r"][0].value)
    pair.close()
    """
)


def test_running_out_of_descriptors_does_not_end_the_accept_loop() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EMFILE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done", done.stderr[-3000:]
    assert "retrying" in done.stderr  # the loop saw EMFILE and went on
