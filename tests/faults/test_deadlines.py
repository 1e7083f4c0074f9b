"""Worker-side deadlines (engine/roles/) on a fake clock: a wait on a peer that
never ends is failed within its bound, and the blocks come back."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.roles.base import KVDestination
from pdserve.engine.roles.decode import DecodeRole
from pdserve.engine.roles.prefill import PrefillRole
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import TransferStatus
from tests.engine.roles.fakes import FakeReceiver

NUM_BLOCKS = 16


class FakeSender:
    """Never hears an ack; `abort` ends the request FAILED at the next poll."""

    backend = "tcp"

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.finished: list[tuple[str, TransferStatus, str | None]] = []

    def status(self, request_id: str) -> TransferStatus:
        return TransferStatus.TRANSFERRING

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.finished.append((request_id, TransferStatus.FAILED, "aborted"))

    def pop_finished(self) -> list[tuple[str, TransferStatus, str | None]]:
        finished, self.finished = self.finished, []
        return finished


def request(request_id: str = "r") -> Request:
    return Request(request_id, list(range(40)), SamplingParams(max_tokens=4))


def decode_role(now: list[float]) -> tuple[DecodeRole, FakeReceiver, KVCacheManager]:
    kv = KVCacheManager(NUM_BLOCKS, 16, model_id="m")
    rx = FakeReceiver()
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    handoff = DecodeRole(rx, scheduler, kv, lambda r, s: None, 30.0, 5.0, clock=lambda: now[0])
    return handoff, rx, kv


def test_reservation_no_prefill_ever_fills_is_released() -> None:
    now = [0.0]
    handoff, rx, kv = decode_role(now)
    assert handoff.reserve(request()) is not None and kv.num_free_blocks == NUM_BLOCKS - 3
    now[0] = 29.9
    assert handoff.poll() == []
    now[0] = 30.1
    assert handoff.poll() == [("r", "no KV within 30.0 s")]
    assert rx.released == ["r"] and kv.num_free_blocks == NUM_BLOCKS
    assert not handoff.awaiting
    assert handoff.transfer_failures == {"reserve_timeout": 1}  # counted, never silent


def test_kv_not_landing_after_the_first_token_fails_sooner() -> None:
    now = [0.0]
    handoff, rx, kv = decode_role(now)
    handoff.reserve(request())
    now[0] = 1.0
    handoff.start("r", 7)
    now[0] = 5.9
    assert handoff.poll() == []
    now[0] = 6.1
    [(request_id, error)] = handoff.poll()
    assert request_id == "r" and "did not land within 5.0 s" in error
    assert kv.num_free_blocks == NUM_BLOCKS
    assert handoff.transfer_failures == {"land_timeout": 1}


def test_kv_landing_in_time_is_never_failed() -> None:
    now = [0.0]
    handoff, rx, kv = decode_role(now)
    handoff.reserve(request())
    handoff.start("r", 7)
    rx.finished.append(("r", TransferStatus.DONE, None))
    assert handoff.poll() == [] and "r" in handoff.scheduler.requests
    now[0] = 100.0
    assert handoff.poll() == []
    assert not handoff.transfer_failures


def test_unacknowledged_send_is_aborted_and_its_blocks_freed() -> None:
    now = [0.0]
    kv = KVCacheManager(NUM_BLOCKS, 16, model_id="m")
    sender = FakeSender()
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    handoff = PrefillRole(
        sender, scheduler, kv, 2, "layerwise", list, None, 5.0, clock=lambda: now[0]
    )
    r = request()
    assert kv.allocate(r, r.num_prompt_tokens)
    handoff.add_prefill(r, KVDestination({"host": "x"}, [0, 1, 2]))
    handoff.on_finished(r)  # first token out: SENDING_KV, blocks pinned
    assert handoff.poll() == [] and kv.num_free_blocks == NUM_BLOCKS - 3
    now[0] = 5.1
    # Aborted; freed once the sender confirms it stopped reading (this fake does at once).
    assert handoff.poll() == [("r", "KV send not acknowledged within 5.0 s")]
    assert sender.aborted == ["r"]
    assert kv.num_free_blocks == NUM_BLOCKS and not handoff.handoffs
    assert handoff.transfer_failures == {"send_timeout": 1}


def test_the_routers_abort_is_not_counted_as_a_failed_send() -> None:
    kv = KVCacheManager(NUM_BLOCKS, 16, model_id="m")
    sender = FakeSender()
    scheduler = Scheduler(SchedulerConfig(), kv, 256)
    handoff = PrefillRole(sender, scheduler, kv, 2, "layerwise", list, None, 5.0)
    r = request()
    assert kv.allocate(r, r.num_prompt_tokens)
    handoff.add_prefill(r, KVDestination({"host": "x"}, [0, 1, 2]))
    handoff.on_finished(r)
    handoff.abort("r")  # the router's Abort: the client left
    assert handoff.poll() == [("r", "aborted")]
    assert not handoff.transfer_failures
    sender.finished.append(("s", TransferStatus.FAILED, "connection lost"))
    handoff.poll()
    assert handoff.transfer_failures == {"send_failed": 1}
