"""The mooncake backend's own rules (the shared contract runs over it in test_transfer.py):
Mooncake's engine admits writes only into ranges of a lease being written, pdserve's
authenticated connection carries every control message, and a failed peer fails the send,
frees the reservation and is counted under its own label."""

from __future__ import annotations

import dataclasses
import socket
import time
from types import SimpleNamespace

import msgpack
import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.base import KVDestination
from pdserve.engine.roles.prefill import PrefillRole
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import make_receiver, make_sender, mooncake, wire
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.mooncake import Endpoint, run_offset
from tests.transfer.conftest import (
    LAYOUT,
    MOONCAKE_MISSING,
    SECRET,
    Pair,
    assert_status,
    wait_finished,
)

pytestmark = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING)


@pytest.fixture
def pair():
    p = Pair("mooncake")
    yield p
    p.close()


@pytest.fixture(scope="module")
def stranger() -> Endpoint:
    """An engine of its own, not the process's shared one: a host without the secret."""
    return Endpoint("127.0.0.1")


def raw_write(stranger: Endpoint, pair: Pair, layer: int, block: int) -> int:
    """Write one block straight to the receiver's engine, as a host on the network without
    the cluster secret could: Mooncake's return code (0: written)."""
    src = torch.full((LAYOUT.block_bytes,), 5, dtype=torch.uint8)
    dst = pair.peer["mooncake"]["kv_ptr"] + run_offset(LAYOUT, layer, block)
    session = pair.peer["mooncake"]["session"]
    return stranger.engine.batch_transfer_sync_write(
        session, [src.data_ptr()], [dst], [LAYOUT.block_bytes]
    )


def test_layerwise_sends_land_with_meta_and_name_the_backend(pair: Pair) -> None:
    layers, src, dst = list(range(LAYOUT.num_layers)), [0, 1, 2, 9], [4, 5, 6, 20]
    pair.rx.expect("r", dst)
    for layer in layers:
        last = layer == layers[-1]
        pair.tx.send(pair.peer, "r", [layer], src, dst, last=last, meta={"k": 1} if last else None)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.DONE)
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.DONE)
    pair.assert_landed(layers, src, dst)
    assert pair.rx.meta("r") == {"k": 1}
    assert list(pair.tx.stats()["peers"].values()) == ["mooncake"]
    assert pair.rx.stats()["num_frames"] == 2 * LAYOUT.num_layers  # two runs a layer


def test_the_engine_refuses_writes_outside_a_lease(pair: Pair, stranger: Endpoint) -> None:
    """Mooncake authenticates nobody: only ranges of a lease in progress are registered, so
    a write straight to its port before the request's lease, or after it ended, is refused
    and the pool keeps its bytes."""
    pair.rx.expect("r", [3])
    assert raw_write(stranger, pair, 0, 3) != 0  # reserved, but no lease yet
    pair.tx.send(pair.peer, "r", [0], [1], [3], last=True)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.DONE)
    assert raw_write(stranger, pair, 0, 3) != 0  # the lease ended
    assert raw_write(stranger, pair, 1, 7) != 0  # never reserved
    pair.assert_landed([0], [1], [3])


def test_a_sender_without_the_secret_is_refused(pair: Pair) -> None:
    pair.rx.expect("r", [0])
    impostor = make_sender("mooncake", torch.randn(LAYOUT.shape), LAYOUT, b"another-secret")
    try:
        impostor.send(pair.peer, "r", [0], [0], [0], last=True)
        assert_status(wait_finished(impostor, ["r"]), "r", TransferStatus.FAILED)
    finally:
        impostor.close()
    assert pair.rx.stats()["rejected_auth"] == 1
    assert pair.rx.status("r") == TransferStatus.WAITING
    assert torch.equal(pair.rx_kv, pair.initial)


def test_a_forged_lease_is_refused_and_registers_nothing(pair: Pair, stranger: Endpoint) -> None:
    """A lease frame sent without the HMAC handshake: the connection is closed unread and
    the engine still refuses the blocks."""
    pair.rx.expect("r", [2])
    header = msgpack.packb({"type": wire.LEASE, "request_id": "r", "writes": [[0, 2, 1]]})
    with socket.create_connection((pair.peer["host"], pair.peer["port"]), timeout=5) as sock:
        # padded past the handshake's answer, so its MAC is checked (and fails) at once
        sock.sendall((len(header).to_bytes(4, "big") + header).ljust(4096, b"\0"))
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):  # closed with our bytes unread
            while sock.recv(4096):
                pass
    deadline = time.monotonic() + 5
    while pair.rx.stats()["rejected_auth"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert raw_write(stranger, pair, 0, 2) != 0
    assert pair.rx.status("r") == TransferStatus.WAITING


def dead_engine(peer: dict) -> dict:
    """The receiver's address with its engine gone (nothing listens on port 1)."""
    return {**peer, "mooncake": {**peer["mooncake"], "session": "127.0.0.1:1"}}


def test_an_unreachable_engine_fails_the_send_and_frees_the_reservation(pair: Pair) -> None:
    pair.rx.expect("r", [0, 1])
    pair.tx.send(dead_engine(pair.peer), "r", [0, 1], [0, 1], [0, 1], last=True)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.FAILED, "mooncake write")
    # the sender ended its lease and aborted: the receiver fails the request at once
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.FAILED, "aborted")
    assert pair.rx.release("r") is True
    assert pair.rx.stats()["num_fenced"] == 0
    assert torch.equal(pair.rx_kv, pair.initial)


def test_a_failed_mooncake_send_is_counted_under_its_own_label() -> None:
    """A prefill role over a real mooncake sender whose receiver's engine is gone counts
    the failure as mooncake_send_failed (pdserve_kv_transfer_failures_total's reason)."""
    layout = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    rx = make_receiver("mooncake", torch.zeros(layout.shape), layout, SECRET)
    tx = make_sender("mooncake", torch.randn(layout.shape), layout, SECRET)
    try:
        kv = KVCacheManager(layout.num_blocks, layout.block_size, model_id="m")
        role = PrefillRole(tx, Scheduler(SchedulerConfig(), kv, 64), kv, 2, "full", lambda r: None)
        request = Request("r", list(range(6)), SamplingParams(max_tokens=4))
        request.block_ids = [0, 1]
        rx.expect("r", [3, 4])
        role.add_prefill(request, KVDestination(dead_engine(rx.address()), [3, 4], 0))
        role.plan(SchedulerOutput([(request, 6)]))
        request.num_computed_tokens = 6
        role.after_step()
        deadline = time.monotonic() + 10
        while not (failed := role.poll()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [request_id for request_id, _ in failed] == ["r"]
        assert role.transfer_failures == {"mooncake_send_failed": 1}
    finally:
        tx.close()
        rx.close()


class StalledEngine:
    """A Mooncake engine whose writes are accepted, then neither complete nor fail, until
    ``resolved``: then they complete, and later writes go to the real engine."""

    STALLED = 1  # a batch id; real ones are addresses

    def __init__(self) -> None:
        self.real, self.resolved = None, False

    def transfer_submit_write(self, *args) -> int:
        return self.real.transfer_submit_write(*args) if self.resolved else self.STALLED

    def transfer_check_status(self, batch_id: int) -> int:
        if batch_id == self.STALLED:
            return 1 if self.resolved else 0
        return self.real.transfer_check_status(batch_id)


def test_a_stalled_write_keeps_its_blocks_fenced_until_it_resolves(monkeypatch) -> None:
    """A chunk that neither completes nor fails may still land: the sender fails the request
    but keeps its lease, so the receiver fences the blocks rather than hand them to another
    request (docs/transfer.md, "Fencing"); once the chunk resolves, the next write on the
    connection ends the lease and the blocks are free."""
    monkeypatch.setattr(mooncake, "STALL_TIMEOUT_S", 0.2)
    engine = StalledEngine()

    def stalled(ctx):
        engine.real = ctx.mooncake.endpoint.engine
        peer = dataclasses.replace(ctx.mooncake, endpoint=SimpleNamespace(engine=engine))
        return mooncake.MooncakeWriter(dataclasses.replace(ctx, mooncake=peer))

    p = Pair("mooncake", tx_opts={"make_writer": stalled})
    try:
        p.rx.expect("r", [0, 1])
        p.tx.send(p.peer, "r", [0], [0, 1], [0, 1], last=True)
        assert_status(wait_finished(p.tx, ["r"]), "r", TransferStatus.FAILED, "stalled")
        assert_status(wait_finished(p.rx, ["r"]), "r", TransferStatus.FAILED, "aborted")
        assert p.rx.release("r") is False  # the lease never ended: a write may still land
        assert p.rx.stats()["num_fenced"] == 1 and p.rx.pop_unfenced() == []
        engine.resolved = True
        p.rx.expect("next", [5])
        p.tx.send(p.peer, "next", [0], [5], [5], last=True)
        assert_status(wait_finished(p.tx, ["next"]), "next", TransferStatus.DONE)
        deadline = time.monotonic() + 5
        while (unfenced := p.rx.pop_unfenced()) == []:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert unfenced == ["r"]
    finally:
        p.close()
