"""Resource limits: bandwidth cap, bounded staging memory, shm segment cleanup, auto."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.limits import BURST_BYTES
from pdserve.transfer.peer import parse_peer
from pdserve.transfer.shm import SHM_DIR, create_shared_kv
from tests.transfer.conftest import (
    LAYOUT,
    SECRET,
    Pair,
    assert_status,
    needs_mooncake,
    random_kv,
    wait_finished,
)

ROOT = Path(__file__).resolve().parents[2]
# 64 blocks x 8 KiB per layer: one run of 512 KiB per layer, 2 MiB in all.
BIG = KVLayout(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=16)
ALL = list(range(BIG.num_layers))
IDS = list(range(BIG.num_blocks))
BACKENDS = ["tcp", "shm", pytest.param("mooncake", marks=needs_mooncake)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bandwidth_cap_lower_bound(backend: str) -> None:
    rate_bps = 64e6  # 8 MB/s: 2 MiB takes >= ~0.25 s; the burst allowance is excluded
    p = Pair(backend, BIG, tx_opts={"bandwidth_bps": rate_bps})
    try:
        nbits = 8 * BIG.total_bytes
        p.rx.expect("r", IDS)
        start = time.monotonic()
        p.tx.send(p.peer, "r", ALL, IDS, IDS, last=True)
        assert_status(wait_finished(p.rx, ["r"]), "r", TransferStatus.DONE)
        elapsed = time.monotonic() - start
        burst_bits = 8 * BURST_BYTES
        assert elapsed >= 0.95 * (nbits - burst_bits) / rate_bps  # lower bound only
        p.assert_landed(ALL, IDS, IDS)
    finally:
        p.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_sent_after_idle_is_still_paced(backend: str) -> None:
    """Layer-wise sends idle between layers while the next one computes; the burst the
    bucket refills to meanwhile must stay well under one layer (512 KiB here), or the
    last layer's transfer time, the part layer-wise transfer cannot hide, would vanish."""
    rate_bps = 64e6
    p = Pair(backend, BIG, tx_opts={"bandwidth_bps": rate_bps})
    try:
        p.rx.expect("r", IDS)
        time.sleep(0.2)  # idle: the bucket refills to its burst
        start = time.monotonic()
        p.tx.send(p.peer, "r", [0], IDS, IDS, last=True)
        assert_status(wait_finished(p.rx, ["r"]), "r", TransferStatus.DONE)
        elapsed = time.monotonic() - start
        layer_bits = 8 * BIG.num_blocks * BIG.block_bytes
        assert elapsed >= 0.95 * (layer_bits - 8 * BURST_BYTES) / rate_bps
    finally:
        p.close()


def test_tiny_receiver_pool_still_completes_large_transfer() -> None:
    """One 16 KiB staging buffer (2 blocks) carries a 2 MiB transfer, frame by frame."""
    p = Pair("tcp", BIG, rx_opts={"pool_bytes": 16384, "buffer_bytes": 16384})
    try:
        assert p.peer["max_frame_bytes"] == 16384
        p.rx.expect("r", IDS)
        p.tx.send(p.peer, "r", ALL, IDS, IDS, last=True)
        assert_status(wait_finished(p.rx, ["r"]), "r", TransferStatus.DONE)
        p.assert_landed(ALL, IDS, IDS)
        pool = p.rx.stats()["pool"]
        assert pool["num_buffers"] == 1 and pool["max_in_use"] == 1
        counts = p.tx.stats()["requests"]["r"]
        assert counts["num_writes"] == BIG.num_layers  # still one write per run per layer
        assert counts["num_frames"] == BIG.num_layers * BIG.num_blocks // 2
    finally:
        p.close()


def test_sender_staging_pool_is_bounded() -> None:
    """Staged sends (the device -> host path of GPU backends) use one small buffer."""
    opts = {"stage": True, "pool_bytes": 16384, "buffer_bytes": 16384}
    p = Pair("tcp", BIG, tx_opts=opts)
    try:
        p.rx.expect("r", IDS)
        p.tx.send(p.peer, "r", ALL, IDS, IDS, last=True)
        assert_status(wait_finished(p.tx, ["r"]), "r", TransferStatus.DONE)
        p.assert_landed(ALL, IDS, IDS)
        assert p.tx.pool.stats()["max_in_use"] == 1
    finally:
        p.close()


def test_shm_segment_removed_on_close() -> None:
    p = Pair("shm")
    path = os.path.join(SHM_DIR, p.shm_name)
    assert os.path.exists(path) and p.peer["shm_name"] == p.shm_name
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    p.close()
    assert not os.path.exists(path)


def test_auto_picks_shm_on_same_host_and_tcp_otherwise() -> None:
    kv, _name = create_shared_kv(LAYOUT)
    rx_auto = make_receiver("auto", kv, LAYOUT, SECRET)  # offers shm + tcp
    rx_tcp = make_receiver("tcp", torch.zeros(LAYOUT.shape), LAYOUT, SECRET)
    tx = make_sender("auto", random_kv(), LAYOUT, SECRET)
    try:
        peer_shm, peer_tcp = rx_auto.address(), rx_tcp.address()
        assert set(peer_shm["backends"]) == {"tcp", "shm"} and peer_tcp["backends"] == ["tcp"]
        rx_auto.expect("a", [0])
        rx_tcp.expect("b", [0])
        tx.send(peer_shm, "a", [0], [0], [0], last=True)
        tx.send(peer_tcp, "b", [0], [0], [0], last=True)
        assert_status(wait_finished(rx_auto, ["a"]), "a", TransferStatus.DONE)
        assert_status(wait_finished(rx_tcp, ["b"]), "b", TransferStatus.DONE)
        peers = tx.stats()["peers"]
        assert peers[f"127.0.0.1:{peer_shm['port']}"] == "shm"
        assert peers[f"127.0.0.1:{peer_tcp['port']}"] == "tcp"
    finally:
        tx.close()
        rx_auto.close()
        rx_tcp.close()
    # Another host (different host identity) never gets shm, even when it is offered.
    remote = parse_peer({**peer_shm, "host_id": "other-host/boot"}, LAYOUT, "auto")
    assert not remote.use_shm
    assert parse_peer(peer_shm, LAYOUT, "auto").use_shm
    assert not parse_peer(peer_shm, LAYOUT, "tcp").use_shm
    # Same host name and boot id, but another /dev/shm (a container, a mount namespace):
    # the offered segment is not the file this process sees, so tcp.
    elsewhere = {**peer_shm, "shm_file": [peer_shm["shm_file"][0], peer_shm["shm_file"][1] + 1]}
    assert not parse_peer(elsewhere, LAYOUT, "auto").use_shm
    with pytest.raises(ValueError, match="does not share this process's /dev/shm"):
        parse_peer(elsewhere, LAYOUT, "shm")
    assert not parse_peer({**peer_shm, "shm_file": None}, LAYOUT, "auto").use_shm


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)"
)
def test_a_sender_with_its_own_dev_shm_picks_tcp() -> None:
    """A process in a mount namespace with a private tmpfs on /dev/shm (as the namespace
    hosts of a test of several hosts have) sees no receiver segment: auto is tcp there."""
    kv, _name = create_shared_kv(LAYOUT)
    rx = make_receiver("auto", kv, LAYOUT, SECRET)
    try:
        peer = json.dumps(rx.address())
        code = (
            "import json, sys; from pdserve.transfer.peer import parse_peer; "
            "from tests.transfer.conftest import LAYOUT; "
            "print(parse_peer(json.loads(sys.argv[1]), LAYOUT, 'auto').use_shm)"
        )
        inside = f'mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c "$0" "$1"'
        out = subprocess.run(
            ["unshare", "--mount", "sh", "-c", inside, code, peer],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False"]
        same = subprocess.run(
            [sys.executable, "-c", code, peer],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert same.stdout.split() == ["True"], same.stderr
    finally:
        rx.close()
