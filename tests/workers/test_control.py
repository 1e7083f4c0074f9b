"""A worker's control socket: a new router's Hello makes it drop every request it holds, in
any state, free their blocks, and announce itself again with the same incarnation; replayed
frames are dropped; frames over the size bound are refused while a whole context fits."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from pdserve import messages as m
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.transfer import KVTransferConfig
from pdserve.workers.spec import WorkerSpec

SECRET = b"k" * 32
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


class FakeRouter:
    def __init__(self, spec: WorkerSpec) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(spec.router_address)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(spec.ctrl_address)
        self.signer, self.verifier = m.Signer(SECRET), m.Verifier(SECRET)
        self.seen: list = []  # every message received

    def send(self, message) -> None:
        self.push.send(self.signer.encode(message))

    def expect(self, kind: type, timeout_s: float = 30.0, where=lambda msg: True):
        """The next message of `kind` (others are kept in `seen`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.pull.poll(100):
                msg = self.verifier.decode(self.pull.recv())
                self.seen.append(msg)
                if isinstance(msg, kind) and where(msg):
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()


@pytest.fixture(params=["collocated", "decode"])
def worker(request, tiny_model_dir, tmp_path):
    from pdserve.workers.worker import Worker

    engine = EngineConfig(
        model=str(tiny_model_dir),
        cache=CacheConfig(kv_cache_bytes=64 * 16 * 512),
        device=DeviceConfig(threads=1),
    )
    spec = WorkerSpec(
        "w0",
        request.param,
        engine,
        f"ipc://{tmp_path}/w0",
        f"ipc://{tmp_path}/router",
        kv_transfer=KVTransferConfig(backend="tcp"),
    )
    router = FakeRouter(spec)
    w = Worker(spec, SECRET)
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        yield w, router
    finally:
        router.send(m.Shutdown())
        thread.join(30)
        router.close()
    assert not thread.is_alive()


def test_hello_aborts_what_the_worker_holds_and_frees_its_blocks(worker):
    w, router = worker
    first = router.expect(m.Ready)
    assert first.incarnation == w.signer.session.hex()
    prompt = list(range(3, 40))
    if w.spec.role == "collocated":
        router.send(m.Generate("old-1", prompt, LONG))
        router.expect(m.Tokens)  # running
    else:  # a reservation waiting for KV that its router will never send
        router.send(m.Reserve("old-1", prompt, LONG))
        router.expect(m.Reserved)
    assert w.engine.kv.num_free_blocks < w.engine.kv.num_blocks
    router.send(m.Hello())
    again = router.expect(m.Ready)
    assert again.hello and again.incarnation == first.incarnation  # the same process
    deadline = time.monotonic() + 10
    while w.engine.kv.num_free_blocks < w.engine.kv.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_blocks
    assert not w.engine.has_unfinished_requests() and w.engine.role.num_in_flight() == 0
    # Nothing of the old request reaches the new router; new work is served.
    router.send(m.Generate("new-1", prompt, {"max_tokens": 3, "temperature": 0}))
    done = router.expect(m.Tokens, where=lambda t: t.finished)
    assert done.request_id == "new-1"
    assert not [
        x for x in router.seen if isinstance(x, m.Tokens) and x.finished and x.request_id == "old-1"
    ]


@pytest.mark.parametrize("worker", ["collocated"], indirect=True)
def test_a_replayed_request_is_not_run_again(worker):
    w, router = worker
    router.expect(m.Ready)
    frame = router.signer.encode(m.Generate("r1", [5, 6, 7], {"max_tokens": 2}))
    router.push.send(frame)
    router.expect(m.Tokens, where=lambda t: t.finished)
    router.push.send(frame)  # as an attacker who recorded it would
    router.send(m.Generate("r2", [5, 6, 7], {"max_tokens": 2}))
    router.expect(m.Tokens, where=lambda t: t.finished and t.request_id == "r2")
    runs = [x for x in router.seen if isinstance(x, (m.Tokens, m.Rejected))]
    assert [x.request_id for x in runs if getattr(x, "finished", True)] == ["r1", "r2"]


@pytest.mark.parametrize("worker", ["decode"], indirect=True)
def test_generate_carries_the_planners_chunk_to_the_request(worker):
    w, router = worker
    router.expect(m.Ready)
    router.send(m.Generate("bad", [5, 6, 7], {"max_tokens": 2}, prefill_chunk_tokens=0))
    assert "prefill_chunk_tokens" in router.expect(m.Rejected).reason
    router.send(m.Generate("c1", list(range(3, 40)), LONG, prefill_chunk_tokens=4))
    router.expect(m.Tokens, where=lambda t: t.request_id == "c1")
    assert w.engine.scheduler.requests["c1"].prefill_chunk_tokens == 4
    router.send(m.Generate("bad2", [5, 6, 7], {"max_tokens": 2}, stall_budget_s=0.0))
    assert "stall_budget_s" in router.expect(m.Rejected).reason
    router.send(m.Generate("c2", list(range(3, 40)), LONG, stall_budget_s=1.5))
    router.expect(m.Tokens, where=lambda t: t.request_id == "c2")
    assert w.engine.scheduler.requests["c2"].stall_budget_s == 1.5


@pytest.mark.parametrize("worker", ["collocated"], indirect=True)
def test_frames_over_the_bound_are_refused_and_a_whole_context_fits(worker):
    w, router = worker
    router.expect(m.Ready)
    bound = m.max_frame_bytes(w.engine.max_model_len)
    assert w.ctrl.getsockopt(zmq.MAXMSGSIZE) == bound
    # The largest legitimate message: a prompt of the whole context but one token.
    prompt = [7] * (w.engine.max_model_len - 1)
    big = m.Generate("whole", prompt, {"max_tokens": 1, "stop": ["\U0010ffff" * 256] * 16})
    assert len(router.signer.encode(big)) <= bound
    router.send(big)
    done = router.expect(m.Tokens, timeout_s=60, where=lambda t: t.finished)
    assert done.request_id == "whole" and done.num_prompt_tokens == len(prompt)
    # One byte over: ZMQ drops it (and the connection) before any allocation or decoding.
    attacker = router.ctx.socket(zmq.PUSH)
    attacker.connect(w.spec.ctrl_address)
    attacker.send(b"x" * (bound + 1))
    attacker.close(1000)
    router.send(m.Generate("after", [5, 6], {"max_tokens": 1}))
    router.expect(m.Tokens, where=lambda t: t.finished and t.request_id == "after")


@pytest.mark.parametrize("worker", ["collocated"], indirect=True)
def test_stats_count_the_prompts_taken_in_since_each_ready(worker):
    # The router counts a prompt it sent as queued here until Stats count it: every Generate
    # (refused ones too: each one sent was read), from the Ready a Hello answers again.
    w, router = worker
    router.expect(m.Ready)
    router.send(m.Generate("bad", [5, 6, 7], {"max_tokens": 2}, prefill_chunk_tokens=0))
    router.expect(m.Rejected)
    router.send(m.Generate("c1", list(range(3, 40)), LONG))
    router.expect(m.Stats, where=lambda s: s.num_prompts_received == 2)
    router.send(m.Hello())
    router.expect(m.Ready)
    router.expect(m.Stats, where=lambda s: s.num_prompts_received == 0)
