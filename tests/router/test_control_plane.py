"""The control plane's books on each worker (pdserve/router/control_plane.py): a prompt the
router sent counts in the worker's queue once, whether or not the worker's Stats show it."""

from __future__ import annotations

from pdserve import messages
from pdserve.router.config import RouterConfig, WorkerEndpoint
from pdserve.router.control_plane import ControlPlane


class _Push:
    def send(self, frame: bytes, flags: int = 0) -> None:
        pass


def _plane() -> ControlPlane:
    endpoint = WorkerEndpoint("p0", "prefill", "tcp://127.0.0.1:1")
    plane = ControlPlane(RouterConfig(model="tiny", workers=(endpoint,)))
    worker = plane.workers["p0"]
    worker.ready = messages.Ready("p0", "prefill", "tiny", 64, 16, 1024, [0], 1, 1 << 20)
    worker.last_seen = plane.clock()
    plane._pushes["p0"] = _Push()
    return plane


def _sent(plane: ControlPlane, num_tokens: int) -> tuple[int, int]:
    """A Prefill sent and charged, as the request driver does."""
    prefill = messages.Prefill(f"r{num_tokens}", [1] * num_tokens, {}, "tcp://d", [0])
    assert plane.send("p0", prefill)
    return plane.workers["p0"].charge(num_tokens)


def _stats(plane: ControlPlane, queued: int, received: int) -> None:
    plane._dispatch(messages.Stats("p0", "prefill", 1, 0, 64, 64, queued, received))


def _queued(plane: ControlPlane) -> int:
    return next(w.num_queued_prefill_tokens for w in plane.loads() if w.worker_id == "p0")


def test_a_prompt_counts_once_whether_or_not_the_workers_stats_show_it():
    plane = _plane()
    worker = plane.workers["p0"]
    a = _sent(plane, 1400)
    assert _queued(plane) == 1400  # Stats from before it: the router's charge counts it
    _stats(plane, 1400, received=1)
    assert _queued(plane) == 1400  # its Stats count it now: not 1,400 twice
    assert worker.sent_prefill_tokens == 1400  # still in flight until its first token
    _sent(plane, 600)
    _stats(plane, 888, received=1)  # a chunk of the first done; the second not read yet
    assert _queued(plane) == 888 + 600
    worker.release(a, 1400)  # the first one's first token
    _stats(plane, 600, received=2)
    assert (_queued(plane), worker.sent_prefill_tokens) == (600, 600)


def test_a_charge_from_before_the_worker_came_back_is_not_released_against_the_new_one():
    plane = _plane()
    worker = plane.workers["p0"]
    old = _sent(plane, 500)
    plane._dispatch(messages.Ready("p0", "prefill", "tiny", 64, 16, 1024, [0], 1, 1 << 20))
    assert (worker.num_prompts_sent, worker.sent_prefill_tokens, _queued(plane)) == (0, 0, 0)
    _sent(plane, 300)
    worker.release(old, 500)  # the old request's end, heard late
    assert (worker.sent_prefill_tokens, _queued(plane)) == (300, 300)
