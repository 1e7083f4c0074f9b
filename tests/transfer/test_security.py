"""Authentication and payload checks, driven by a raw client that can send bad frames."""

from __future__ import annotations

import socket
import zlib

import pytest
import torch

from pdserve.transfer import wire as P
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.wire import MAGIC, NONCE_BYTES, AuthError, client_handshake
from tests.transfer.conftest import LAYOUT, SECRET, Pair, assert_status, wait_finished

BB = LAYOUT.block_bytes


@pytest.fixture
def tcp_pair():
    p = Pair("tcp")
    yield p
    p.close()


def raw_client(peer: dict, secret: bytes = SECRET) -> socket.socket:
    sock = P.connect(peer["host"], peer["port"], 5.0)
    client_handshake(sock, secret)
    P.send_frame(sock, {"type": P.HELLO, "layout": LAYOUT.to_dict()})
    assert P.recv_header(sock)["type"] == P.HELLO_OK
    return sock


def data_frame(sock, request_id, dst_start, num_blocks, payload: bytes, overrides=None) -> None:
    header = {
        "type": P.DATA,
        "request_id": request_id,
        "layer": 0,
        "dst_start": dst_start,
        "num_blocks": num_blocks,
        "nbytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    P.send_frame(sock, {**header, **(overrides or {})}, payload)


def test_wrong_secret_is_refused_and_writes_nothing(tcp_pair: Pair) -> None:
    tcp_pair.rx.expect("r", [0])
    sock = P.connect(tcp_pair.peer["host"], tcp_pair.peer["port"], 5.0)
    with pytest.raises(AuthError):
        client_handshake(sock, b"not-the-secret")
    sock.close()
    assert tcp_pair.rx.stats()["rejected_auth"] == 1
    tcp_pair.assert_landed([], [], [])


def test_raw_socket_without_handshake_is_dropped_before_payload(tcp_pair: Pair) -> None:
    """A peer that skips auth and sends a frame straight away is cut off unread."""
    tcp_pair.rx.expect("r", [0])
    sock = P.connect(tcp_pair.peer["host"], tcp_pair.peer["port"], 5.0)
    assert sock.recv(len(MAGIC) + NONCE_BYTES)[: len(MAGIC)] == MAGIC
    payload = torch.ones(BB // 4).numpy().tobytes()
    try:  # garbage where the 64-byte reply belongs, then a well-formed data frame
        data_frame(sock, "r", 0, 1, payload)
        sock.sendall(b"\0" * 64)
    except OSError:
        pass  # the receiver may already have closed
    sock.settimeout(5.0)
    try:
        assert sock.recv(1) == b""  # closed by the receiver
    except ConnectionResetError:
        pass  # closed with our bytes unread: the kernel answers with a reset
    sock.close()
    assert tcp_pair.rx.stats()["rejected_auth"] == 1
    assert tcp_pair.rx.status("r") == TransferStatus.WAITING
    tcp_pair.assert_landed([], [], [])


def test_sender_with_wrong_secret_fails_its_request(tcp_pair: Pair) -> None:
    from pdserve.transfer import make_sender

    tx = make_sender("tcp", tcp_pair.tx_kv, LAYOUT, b"wrong")
    try:
        tcp_pair.rx.expect("r", [0])
        tx.send(tcp_pair.peer, "r", [0], [0], [0], last=True)
        assert_status(wait_finished(tx, ["r"]), "r", TransferStatus.FAILED, "authentication")
    finally:
        tx.close()
    tcp_pair.assert_landed([], [], [])


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"nbytes": BB}, "nbytes"),  # header says 1 block of bytes, claims 2 blocks
        ({"crc32": 12345}, "checksum"),
        ({"dst_start": 3}, "outside the reservation"),
        ({"layer": LAYOUT.num_layers}, "layer"),
    ],
)
def test_bad_frame_fails_request_connection_serves_others(tcp_pair: Pair, overrides, problem):
    rx = tcp_pair.rx
    rx.expect("bad", [0, 1])
    rx.expect("good", [4, 5])
    sock = raw_client(tcp_pair.peer)
    try:
        payload = torch.full((2 * BB // 4,), 3.0).numpy().tobytes()
        if "nbytes" in overrides:  # a short payload, sent in full so the stream stays framed
            data_frame(sock, "bad", 0, 2, payload[:BB], overrides)
        else:
            data_frame(sock, "bad", 0, 2, payload, overrides)
        good = tcp_pair.tx_kv[0, 8:10].reshape(-1).numpy().tobytes()
        data_frame(sock, "good", 4, 2, good)
        P.send_frame(sock, {"type": P.DONE, "request_id": "good", "num_frames": 1})
        replies = {P.recv_header(sock)["type"] for _ in range(2)}
        assert replies == {P.FAILED, P.ACK}
    finally:
        sock.close()
    done = wait_finished(rx, ["bad", "good"])
    assert_status(done, "bad", TransferStatus.FAILED, problem)
    assert_status(done, "good", TransferStatus.DONE)
    tcp_pair.assert_landed([0], [8, 9], [4, 5])  # only "good" touched memory


def test_done_with_missing_frames_fails(tcp_pair: Pair) -> None:
    tcp_pair.rx.expect("r", [0])
    sock = raw_client(tcp_pair.peer)
    try:
        P.send_frame(sock, {"type": P.DONE, "request_id": "r", "num_frames": 3})
        assert P.recv_header(sock)["type"] == P.FAILED
    finally:
        sock.close()
    assert_status(wait_finished(tcp_pair.rx, ["r"]), "r", TransferStatus.FAILED, "frames")


def test_shm_notice_without_lease_is_rejected() -> None:
    p = Pair("shm")
    try:
        p.rx.expect("r", [0])
        sock = raw_client(p.peer)
        P.send_frame(
            sock,
            {
                "type": P.DATA,
                "request_id": "r",
                "layer": 0,
                "dst_start": 0,
                "num_blocks": 1,
                "nbytes": 0,
                "written": True,
            },
        )
        assert P.recv_header(sock)["type"] == P.FAILED
        sock.close()
        assert_status(wait_finished(p.rx, ["r"]), "r", TransferStatus.FAILED, "without a lease")
    finally:
        p.close()
