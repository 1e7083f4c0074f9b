"""The sender's own counts: the shm -> tcp fallback (a receiver that offers shm whose segment
cannot be mapped still gets its KV, over tcp, and the fallback is counted, never silent), and
the seconds spent writing, from which the planner takes the link's rate."""

from __future__ import annotations

import time

from pdserve.transfer import make_receiver, make_sender, sender
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.shm import create_shared_kv, unlink_shared_kv
from tests.transfer.conftest import LAYOUT, SECRET, Pair, random_kv, wait_finished


def unmappable(name: str, layout: object) -> None:
    raise OSError(f"cannot open {name}")


def test_an_unmappable_shm_segment_falls_back_to_tcp_and_is_counted(monkeypatch) -> None:
    rx_kv, shm_name = create_shared_kv(LAYOUT)
    rx = make_receiver("auto", rx_kv, LAYOUT, SECRET, shm_name=shm_name)
    tx = make_sender("auto", random_kv(LAYOUT), LAYOUT, SECRET)
    try:
        peer = rx.address()
        assert "shm" in peer["backends"]
        monkeypatch.setattr(sender, "open_shared_kv", unmappable)
        layers, ids = list(range(LAYOUT.num_layers)), [0, 1, 2]
        for request_id in ("a", "b"):  # the second reuses the tcp connection: one fallback
            rx.expect(request_id, ids)
            tx.send(peer, request_id, layers, ids, ids, last=True)
            assert wait_finished(tx, [request_id])[request_id][0] == TransferStatus.DONE
        assert (rx_kv[:, ids] == tx.kv[:, ids]).all()
        stats = tx.stats()
        assert stats["shm_fallbacks"] == 1
        assert list(stats["peers"].values()) == ["tcp"]
    finally:
        tx.close()
        rx.close()
        unlink_shared_kv(shm_name)


def test_a_shm_only_sender_fails_instead_of_falling_back(monkeypatch) -> None:
    rx_kv, shm_name = create_shared_kv(LAYOUT)
    rx = make_receiver("shm", rx_kv, LAYOUT, SECRET, shm_name=shm_name)
    tx = make_sender("shm", random_kv(LAYOUT), LAYOUT, SECRET)
    try:
        monkeypatch.setattr(sender, "open_shared_kv", unmappable)
        rx.expect("a", [0])
        tx.send(rx.address(), "a", [0], [0], [0], last=True)
        status, error = wait_finished(tx, ["a"])["a"]
        assert status == TransferStatus.FAILED and "cannot map receiver shm" in error
        assert tx.stats()["shm_fallbacks"] == 0
    finally:
        tx.close()
        rx.close()
        unlink_shared_kv(shm_name)


def test_send_seconds_measure_the_rate_the_link_gave() -> None:
    """A sender capped at 8 MB/s (its token bucket stands in for a slow link): 2 MiB sent in
    four layer-wise sends, with idle gaps between them that must not count as link time."""
    layout = KVLayout(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=16)
    p = Pair("tcp", layout, tx_opts={"bandwidth_bps": 64e6})
    try:
        ids = list(range(layout.num_blocks))
        p.rx.expect("r", ids)
        for layer in range(layout.num_layers):
            time.sleep(0.2)  # the next layer computing
            p.tx.send(p.peer, "r", [layer], ids, ids, last=layer == layout.num_layers - 1)
        assert wait_finished(p.tx, ["r"])["r"][0] == TransferStatus.DONE
        stats = p.tx.stats()
        rate = stats["bytes_sent"] / stats["send_s"]
        # the bucket's first burst comes at once: a little over the cap, never the idle rate
        assert 7e6 < rate < 12e6, stats
    finally:
        p.close()
