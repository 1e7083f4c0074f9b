"""A receiver whose host vanishes mid-transfer without a reset (power lost): the sender's
connection is dropped within wire.LINK_TIMEOUT_S, so the request ends and the prefill
worker's blocks are not pinned for TCP's ~15 min of retransmissions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.testing.netns import Hosts, Link, available
from pdserve.transfer import make_sender, wire
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "available")

ROOT = Path(__file__).resolve().parents[2]
BIG = KVLayout(num_layers=8, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64)
SECRET = b"s" * 32
RECEIVE = """
import json, sys, time, torch
from pdserve.transfer import make_receiver
from pdserve.transfer.layout import KVLayout
layout = KVLayout(num_layers=8, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64)
rx = make_receiver("tcp", torch.zeros(layout.shape), layout, b"s" * 32, host=sys.argv[1])
rx.expect("r", list(range(64)))
print(json.dumps(rx.address()), flush=True)
time.sleep(120)
"""


def test_a_receiver_host_that_vanishes_fails_the_send_within_the_link_timeout(monkeypatch):
    monkeypatch.setattr(wire, "LINK_TIMEOUT_S", 2.0)
    with Hosts(["decode"], prefix="pdvp") as hosts:
        receiver = subprocess.Popen(
            [*hosts.prefix_of("decode"), sys.executable, "-c", RECEIVE, hosts.ip("decode")],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        peer = json.loads(receiver.stdout.readline())
        hosts.shape("decode", Link(rate="10mbit"))  # 8 MiB: seconds on the wire
        sender = make_sender("tcp", torch.randn(BIG.shape), BIG, SECRET)
        try:
            ids = list(range(BIG.num_blocks))
            sender.send(peer, "r", list(range(BIG.num_layers)), ids, ids, last=True)
            deadline = time.monotonic() + 10
            while not sender.stats()["bytes_sent"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            hosts.remove("decode")  # mid-transfer, and no reset reaches the sender
            gone = time.monotonic()
            while not (finished := sender.pop_finished()):
                assert time.monotonic() - gone < 2.0 + 6.0, "the send outlived the link timeout"
                time.sleep(0.1)
            [(request_id, status, error)] = finished
            assert (request_id, status) == ("r", TransferStatus.FAILED), error
        finally:
            sender.close()
            receiver.wait(10)
