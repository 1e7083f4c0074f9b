"""The fault hook on its own, in one process: the sender's ``make_writer`` seam wrapped the
way ``faulty_worker`` wraps it in the cluster tests."""

from __future__ import annotations

import time

import pytest

from pdserve.transfer.base import TransferStatus
from tests.faults.faulty_worker import faulty_writers
from tests.transfer.conftest import Pair, assert_status, wait_finished

ALL = [0, 1, 2, 3]


@pytest.fixture(params=["tcp", "shm"])
def faulty(request, tmp_path):
    fault_file = tmp_path / "fault"
    p = Pair(request.param, tx_opts={"make_writer": faulty_writers(str(fault_file))})
    yield p, fault_file
    p.close()


def test_fail_after_layer_lands_only_the_layers_up_to_it(faulty) -> None:
    p, fault_file = faulty
    fault_file.write_text("fail_after_layer:1")
    p.rx.expect("r", [0, 1])
    p.tx.send(p.peer, "r", ALL, [4, 5], [0, 1], last=True)
    assert_status(wait_finished(p.tx, ["r"]), "r", TransferStatus.FAILED, "injected fault")
    assert not fault_file.exists()
    p.assert_landed([0, 1], [4, 5], [0, 1])


def test_drop_done_lands_every_block_and_one_request_only(faulty) -> None:
    p, fault_file = faulty
    fault_file.write_text("drop_done")
    p.rx.expect("r", [0, 1])
    p.tx.send(p.peer, "r", ALL, [4, 5], [0, 1], last=True)
    deadline = time.monotonic() + 5.0
    while p.tx.stats()["requests"]["r"]["num_writes"] < len(ALL):
        assert time.monotonic() < deadline, "blocks not written"
        time.sleep(0.002)
    time.sleep(0.1)
    assert p.rx.status("r") == TransferStatus.TRANSFERRING  # no "done": never completes
    assert p.tx.status("r") == TransferStatus.TRANSFERRING
    p.assert_landed(ALL, [4, 5], [0, 1])
    p.rx.expect("next", [2])  # the fault was claimed: the next request is not faulted
    p.tx.send(p.peer, "next", ALL, [6], [2], last=True)
    assert_status(wait_finished(p.rx, ["next"]), "next", TransferStatus.DONE)
    p.assert_landed(ALL, [4, 5], [0, 1], also=[(ALL, [6], [2])])
