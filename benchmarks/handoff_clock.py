"""Timing one P/D handoff in one process, shared by the transfer benchmarks: run a prefill
engine's request to its end and stamp its start, its last layer (the end of the prefill) and
the moment the decode side's receiver reports the KV landed; then release both sides."""

from __future__ import annotations

import threading
import time

from pdserve.engine.engine import Engine
from pdserve.transfer.base import TransferStatus


def timed_handoff(p: Engine, d: Engine, rx, rid: str) -> dict[str, float]:
    """`start`, `last_layer` and `landed` (perf_counter seconds) of request `rid`, already
    reserved on `d` and added to `p`; afterwards both engines hold none of its blocks."""
    last_layer = p.model_config.num_layers - 1
    stamps: dict[str, float] = {}
    model = p.runner.model
    original = model.forward

    def forward(*args, **kwargs):
        hook = args[4] if len(args) > 4 else kwargs.get("on_layer_done")

        def timed(i):
            if hook:
                hook(i)
            if i == last_layer:
                stamps["last_layer"] = time.perf_counter()

        return original(*args[:4], timed)

    model.forward = forward
    landed = threading.Event()

    def watch():
        while not landed.is_set():
            for request_id, status, _ in rx.pop_finished():
                if request_id == rid and status is TransferStatus.DONE:
                    stamps["landed"] = time.perf_counter()
                    landed.set()
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stamps["start"] = time.perf_counter()
        while p.has_unfinished_requests():
            p.step()
        if not landed.wait(120):
            raise RuntimeError("KV never landed")
    finally:
        model.forward = original
    d.role.awaiting[rid].landed = True  # consumed by the watcher: release the blocks
    d.abort_request(rid)
    while p.role.num_in_flight():
        p.role.poll()
        time.sleep(0.001)
    return stamps
