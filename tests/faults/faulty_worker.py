"""A worker process whose KV sender misbehaves on demand (the fault hook of these tests).

    python -m tests.faults.faulty_worker FAULT_FILE <pdserve.workers.main arguments>

It runs the product's worker unchanged except for the sender's ``make_writer`` seam, whose
default it replaces with one that wraps every data path to consult FAULT_FILE. The first
send job of a request that finds the file claims it (atomic rename, so exactly one request
in the whole cluster gets each fault, whichever prefill worker runs it) and that request's
transfer then misbehaves as the file says:

    drop_done           every block lands, but the final "done" message is never sent
    fail_after_layer:N  layers after N fail with a transfer error (a break mid-request)
    delay_s:X           each send job waits X seconds first (a slow link: stage "transferring")
    stall_copy_s:X      the first copy stalls X seconds after the writer checked it may go on,
                        then lands whatever happened meanwhile (a frozen or descheduled
                        shm writer, seen from the receiver)
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

from pdserve.transfer.peer import BlockWriter, Run, WriteContext
from pdserve.transfer.sender import SocketKVSender, open_writer
from pdserve.transfer.wire import TransferError

KINDS = ("drop_done", "fail_after_layer", "delay_s", "stall_copy_s")


@dataclass(frozen=True)
class Fault:
    kind: str
    value: float = 0.0


NO_FAULT = Fault("none")


def claim(fault_file: str) -> Fault:
    """The pending fault, taken by this caller alone; NO_FAULT when there is none."""
    taken = f"{fault_file}.taken.{os.getpid()}.{time.monotonic_ns()}"
    try:
        os.rename(fault_file, taken)
    except OSError:
        return NO_FAULT
    with open(taken) as f:
        text = f.read().strip()
    kind, _, value = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown fault {text!r} in {fault_file}; choose one of {KINDS}")
    return Fault(kind, float(value or 0))


class StallingBucket:
    """Stands in for the bandwidth bucket, which every writer consults between its stop
    check and each copy: ``stall_s`` set, the next consume sleeps that long first."""

    def __init__(self, inner) -> None:
        self.inner, self.stall_s = inner, 0.0

    def consume(self, bits: float) -> float:
        stall_s, self.stall_s = self.stall_s, 0.0
        time.sleep(stall_s)
        return stall_s + (self.inner.consume(bits) if self.inner is not None else 0.0)


class FaultyWriter(BlockWriter):
    """Wraps a real writer; ``faults`` maps request ids to the fault each claimed."""

    def __init__(
        self,
        inner: BlockWriter,
        fault_file: str,
        faults: dict[str, Fault],
        bucket: StallingBucket | None = None,
    ) -> None:
        super().__init__(inner.ctx)
        self.inner, self.fault_file, self.faults, self.bucket = inner, fault_file, faults, bucket
        self.name = inner.name

    def write(self, request_id: str, layers: list[int], runs: list[Run]) -> None:
        fault = self.faults.get(request_id)
        if fault is None:  # the request's first job
            fault = self.faults[request_id] = claim(self.fault_file)
        if fault.kind == "delay_s":
            time.sleep(fault.value)
        if fault.kind == "stall_copy_s" and self.bucket is not None:
            self.bucket.stall_s = fault.value
            self.faults[request_id] = NO_FAULT  # the first copy only
        if fault.kind == "fail_after_layer" and max(layers, default=-1) > fault.value:
            self.inner.write(request_id, [layer for layer in layers if layer <= fault.value], runs)
            raise TransferError(f"injected fault: transfer failed after layer {int(fault.value)}")
        self.inner.write(request_id, layers, runs)

    def finish(self, request_id: str, num_frames: int, meta: dict | None) -> None:
        if self.faults.get(request_id, NO_FAULT).kind != "drop_done":
            self.inner.finish(request_id, num_frames, meta)


def faulty_writers(fault_file: str):
    """A ``make_writer`` for ``SocketKVSender`` that injects the faults of ``fault_file``."""
    faults: dict[str, Fault] = {}

    def make_writer(ctx: WriteContext) -> BlockWriter:
        bucket = StallingBucket(ctx.bucket)
        inner = open_writer(replace(ctx, bucket=bucket))
        return FaultyWriter(inner, fault_file, faults, bucket)

    return make_writer


def main() -> int:
    fault_file, *argv = sys.argv[1:]
    # The default of the keyword-only argument, so every sender this process builds gets it,
    # however the worker reaches SocketKVSender.
    SocketKVSender.__init__.__kwdefaults__["make_writer"] = faulty_writers(fault_file)
    from pdserve.workers.main import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
