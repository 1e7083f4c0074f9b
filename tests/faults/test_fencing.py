"""A shm writer that stalls after checking it may write, seen through the decode engine's
role: the request is released while the write is still to land, and no other request
may get those blocks until the receiver has proof the writer stopped."""

from __future__ import annotations

import time

import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.decode import DecodeRole
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import make_receiver, make_sender, receiver
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.shm import create_shared_kv, unlink_shared_kv
from tests.faults.faulty_worker import faulty_writers
from tests.transfer.conftest import SECRET, assert_status, random_kv, wait_finished

BLOCK_SIZE = 16
RX_LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8)
TX_LAYOUT = KVLayout(num_layers=2, num_blocks=32, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8)


def _request(request_id: str, num_blocks: int, first_token: int) -> Request:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_stalled_writer_lands_only_in_fenced_blocks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(receiver, "RELEASE_WAIT_S", 0.3)
    fault_file = tmp_path / "fault"
    rx_kv, shm_name = create_shared_kv(RX_LAYOUT)
    rx = make_receiver("shm", rx_kv, RX_LAYOUT, SECRET)
    tx_kv = random_kv(TX_LAYOUT)
    tx = make_sender("shm", tx_kv, TX_LAYOUT, SECRET, make_writer=faulty_writers(str(fault_file)))
    kv = KVCacheManager(RX_LAYOUT.num_blocks, BLOCK_SIZE, model_id="m")
    now = [0.0]
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    handoff = DecodeRole(rx, scheduler, kv, lambda r, s: None, 30.0, 5.0, clock=lambda: now[0])
    try:
        a = handoff.reserve(_request("a", 6, 1000))
        assert a is not None
        fault_file.write_text("stall_copy_s:1.5")
        tx.send(rx.address(), "a", [0, 1], list(range(10, 16)), a.block_ids, last=True)
        _until(lambda: rx.table.get("a") is not None and rx.table.get("a").active_leases == 1)

        now[0] += 31  # a's reservation expires while its writer holds the lease
        assert [rid for rid, _ in handoff.poll()] == ["a"]
        assert "a" in handoff.fenced and rx.stats()["num_fenced"] == 1
        assert handoff.reserve(_request("b", 4, 5000)) is None  # only 2 blocks are free

        # The stalled copy lands after the release (the hazard is real), but the writer then
        # sees the failure, stops, and ends its lease: only then are a's blocks reusable.
        _until(lambda: (handoff.poll(), "a" not in handoff.fenced)[1])
        assert torch.equal(rx_kv[0, a.block_ids], tx_kv[0, 10:16])
        assert kv.num_free_blocks == RX_LAYOUT.num_blocks
        assert_status(wait_finished(tx, ["a"]), "a", TransferStatus.FAILED, "released")

        b = handoff.reserve(_request("b", 4, 5000))
        assert b is not None and set(b.block_ids) & set(a.block_ids)  # a's blocks, reused
        tx.send(rx.address(), "b", [0, 1], list(range(20, 24)), b.block_ids, last=True)
        assert_status(wait_finished(tx, ["b"]), "b", TransferStatus.DONE)
        time.sleep(0.2)
        assert torch.equal(rx_kv[:, b.block_ids], tx_kv[:, 20:24])  # b's KV, uncorrupted
    finally:
        tx.close()
        rx.close()
        unlink_shared_kv(shm_name)
