"""Shared fixtures: a tiny KV layout, random pools, receiver/sender pairs that always close."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.mooncake import unavailable
from pdserve.transfer.shm import create_shared_kv, unlink_shared_kv

torch.set_num_threads(1)

SECRET = b"test-cluster-secret"
LAYOUT = KVLayout(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=8)


def random_kv(layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen)


def wait_finished(end, request_ids: list[str], timeout_s: float = 10.0) -> dict[str, tuple]:
    """Poll ``pop_finished`` like the engine does until every id is terminal."""
    done: dict[str, tuple] = {}
    deadline = time.monotonic() + timeout_s
    while set(request_ids) - done.keys():
        for request_id, status, error in end.pop_finished():
            done[request_id] = (status, error)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; finished so far: {done}")
        time.sleep(0.002)
    return done


class Pair:
    """A receiver whose kv starts as a known pattern, and a sender with random kv."""

    def __init__(self, backend: str, layout: KVLayout = LAYOUT, rx_opts=None, tx_opts=None):
        self.layout = layout
        self.shm_name = None
        if backend == "shm":
            self.rx_kv, self.shm_name = create_shared_kv(layout)
            self.rx_kv.fill_(-7.0)
        else:
            self.rx_kv = torch.full(layout.shape, -7.0)
        self.initial = self.rx_kv.clone()
        self.tx_kv = random_kv(layout)
        self.rx = make_receiver(backend, self.rx_kv, layout, SECRET, **(rx_opts or {}))
        self.tx = make_sender(backend, self.tx_kv, layout, SECRET, **(tx_opts or {}))
        self.peer = self.rx.address()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        if self.shm_name:
            unlink_shared_kv(self.shm_name)

    def assert_landed(self, layers, src_ids, dst_ids, also=()) -> None:
        """dst blocks hold the sent bytes; every other block (per layer) is untouched.
        ``also`` lists (layers, src_ids, dst_ids) of other transfers into this pool."""
        expected = self.initial.clone()
        for ls, ss, ds in [(layers, src_ids, dst_ids), *also]:
            for layer in ls:
                expected[layer, list(ds)] = self.tx_kv[layer, list(ss)]
        assert torch.equal(self.rx_kv, expected)


MOONCAKE_MISSING = unavailable()  # the library's own reason, when it cannot load
needs_mooncake = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING)


@pytest.fixture(params=["tcp", "shm", pytest.param("mooncake", marks=needs_mooncake)])
def pair(request) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


def assert_status(done: dict, request_id: str, status: TransferStatus, match: str = "") -> None:
    got_status, error = done[request_id]
    assert got_status == status, f"{request_id}: {got_status} {error}"
    if match:
        assert match in (error or ""), error
