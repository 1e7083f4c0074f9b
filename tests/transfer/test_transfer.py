"""End-to-end transfers over tcp and shm: bytes land in exactly the reserved blocks."""

from __future__ import annotations

import time

import pytest

from pdserve.transfer.base import TransferStatus
from tests.transfer.conftest import LAYOUT, Pair, assert_status, wait_finished

ALL_LAYERS = list(range(LAYOUT.num_layers))
SRC = [0, 1, 2, 3, 10, 11, 20]
DST = [5, 6, 7, 8, 12, 13, 30]  # runs: 0-3 -> 5-8, 10-11 -> 12-13, 20 -> 30


def test_full_transfer_one_send(pair: Pair) -> None:
    pair.rx.expect("r", DST)
    pair.tx.send(pair.peer, "r", ALL_LAYERS, SRC, DST, last=True)
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.DONE)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.DONE)
    pair.assert_landed(ALL_LAYERS, SRC, DST)
    assert pair.rx.status("r") == TransferStatus.DONE


def test_the_last_send_carries_meta_to_the_receiver(pair: Pair) -> None:
    meta = {"num_dropped_tokens": 16, "kept_block_scores": [0.5, 1.25, 3.0]}
    with pytest.raises(ValueError, match="meta must be a dict on the last send"):
        pair.tx.send(pair.peer, "r", [0], SRC, DST, last=False, meta=meta)
    with pytest.raises(ValueError, match="it must fit a header"):
        pair.tx.send(pair.peer, "r", [0], SRC, DST, last=True, meta={"x": [0.5] * 10_000})
    pair.rx.expect("r", DST)
    pair.rx.expect("plain", [0])
    with pytest.raises(KeyError):
        pair.rx.meta("r")  # not DONE yet
    pair.tx.send(pair.peer, "r", ALL_LAYERS, SRC, DST, last=True, meta=meta)
    pair.tx.send(pair.peer, "plain", [0], [1], [0], last=True)
    done = wait_finished(pair.rx, ["r", "plain"])
    assert_status(done, "r", TransferStatus.DONE)
    assert pair.rx.meta("r") == meta and pair.rx.meta("plain") == {}
    pair.rx.release("r")
    with pytest.raises(KeyError):
        pair.rx.meta("r")


def test_layerwise_many_sends(pair: Pair) -> None:
    pair.rx.expect("r", DST)
    for layer in ALL_LAYERS:
        pair.tx.send(pair.peer, "r", [layer], SRC, DST, last=layer == ALL_LAYERS[-1])
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.DONE)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.DONE)
    pair.assert_landed(ALL_LAYERS, SRC, DST)


def test_chunked_prefill_several_sends_then_last(pair: Pair) -> None:
    """Each chunk sends its newly filled blocks for all layers; the last send may be empty."""
    pair.rx.expect("r", DST)
    chunks = [(SRC[:3], DST[:3]), (SRC[3:6], DST[3:6]), (SRC[6:], DST[6:])]
    for src, dst in chunks:
        pair.tx.send(pair.peer, "r", ALL_LAYERS, src, dst, last=False)
    assert pair.rx.pop_finished() == []  # nothing is DONE before the last=True send
    pair.tx.send(pair.peer, "r", [], [], [], last=True)
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.DONE)
    pair.assert_landed(ALL_LAYERS, SRC, DST)


def test_coalescing_one_write_per_contiguous_run(pair: Pair) -> None:
    pair.rx.expect("r", DST)
    pair.tx.send(pair.peer, "r", ALL_LAYERS, SRC, DST, last=True)
    wait_finished(pair.tx, ["r"])
    counts = pair.tx.stats()["requests"]["r"]
    assert counts["num_writes"] == 3 * LAYOUT.num_layers
    assert counts["bytes_sent"] == len(SRC) * LAYOUT.num_layers * LAYOUT.block_bytes


def test_src_run_but_dst_gap_is_two_writes(pair: Pair) -> None:
    pair.rx.expect("r", [4, 6])
    pair.tx.send(pair.peer, "r", [0], [1, 2], [4, 6], last=True)
    wait_finished(pair.tx, ["r"])
    assert pair.tx.stats()["requests"]["r"]["num_writes"] == 2
    pair.assert_landed([0], [1, 2], [4, 6])


def test_concurrent_requests_share_a_connection(pair: Pair) -> None:
    pair.rx.expect("a", [0, 1])
    pair.rx.expect("b", [2, 3])
    for layer in ALL_LAYERS:
        last = layer == ALL_LAYERS[-1]
        pair.tx.send(pair.peer, "a", [layer], [4, 5], [0, 1], last=last)
        pair.tx.send(pair.peer, "b", [layer], [8, 9], [2, 3], last=last)
    done = wait_finished(pair.rx, ["a", "b"])
    assert_status(done, "a", TransferStatus.DONE)
    assert_status(done, "b", TransferStatus.DONE)
    pair.assert_landed(ALL_LAYERS, [4, 5], [0, 1], also=[(ALL_LAYERS, [8, 9], [2, 3])])


def test_out_of_reservation_write_fails_only_that_request(pair: Pair) -> None:
    pair.rx.expect("bad", [0, 1])
    pair.rx.expect("good", [2, 3])
    pair.tx.send(pair.peer, "bad", [0], [0, 1], [1, 2], last=True)  # block 2 is not its own
    pair.tx.send(pair.peer, "good", ALL_LAYERS, [4, 5], [2, 3], last=True)
    done = wait_finished(pair.rx, ["bad", "good"])
    assert_status(done, "bad", TransferStatus.FAILED, "outside the reservation")
    assert_status(done, "good", TransferStatus.DONE)
    assert_status(wait_finished(pair.tx, ["bad"]), "bad", TransferStatus.FAILED, "outside")
    pair.assert_landed(ALL_LAYERS, [4, 5], [2, 3])  # "bad" wrote nothing at all


def test_release_then_late_write_is_rejected(pair: Pair) -> None:
    pair.rx.expect("r", [0, 1])
    pair.rx.release("r")
    with pytest.raises(KeyError):
        pair.rx.status("r")
    pair.tx.send(pair.peer, "r", ALL_LAYERS, [4, 5], [0, 1], last=True)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.FAILED, "reservation")
    assert pair.rx.pop_finished() == []
    pair.assert_landed([], [], [])


def test_release_mid_transfer_stops_later_layers(pair: Pair) -> None:
    pair.rx.expect("r", [0, 1])
    pair.tx.send(pair.peer, "r", [0], [4, 5], [0, 1], last=False)
    wait_until(lambda: pair.rx.status("r") == TransferStatus.TRANSFERRING)
    pair.rx.release("r")
    pair.tx.send(pair.peer, "r", [1, 2, 3], [4, 5], [0, 1], last=True)
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.FAILED)
    pair.assert_landed([0], [4, 5], [0, 1])  # layer 0 landed before release, nothing after


def test_abort_fails_both_ends(pair: Pair) -> None:
    pair.rx.expect("r", [0, 1])
    pair.tx.send(pair.peer, "r", [0], [4, 5], [0, 1], last=False)
    pair.tx.abort("r")
    assert_status(wait_finished(pair.tx, ["r"]), "r", TransferStatus.FAILED, "aborted")
    assert_status(wait_finished(pair.rx, ["r"]), "r", TransferStatus.FAILED, "aborted")
    pair.tx.send(pair.peer, "r", [1], [4, 5], [0, 1], last=True)  # late layer: dropped


def test_send_argument_errors_raise_at_once() -> None:
    p = Pair("tcp")
    try:
        with pytest.raises(ValueError, match="same length"):
            p.tx.send(p.peer, "r", [0], [1, 2], [1], last=True)
        with pytest.raises(ValueError, match="outside"):
            p.tx.send(p.peer, "r", [LAYOUT.num_layers], [1], [1], last=True)
        with pytest.raises(ValueError, match="layout mismatch"):
            p.tx.send(
                {**p.peer, "layout": {**p.peer["layout"], "head_dim": 4}},
                "r",
                [0],
                [1],
                [1],
                last=True,
            )
        with pytest.raises(ValueError, match="does not offer shm"):
            from pdserve.transfer import make_sender

            make_sender("shm", p.tx_kv, LAYOUT, b"s").send(p.peer, "r", [0], [1], [1], True)
    finally:
        p.close()


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)
