"""Test-only fault injection for the KV sender. Off (one `is None` check per job) unless
PDSERVE_FAULT_FILE is set; nothing in production sets it.

The variable names a file. The first send job of a request that finds the file claims it
(atomic rename, so exactly one request in the whole cluster gets each fault, whichever
prefill worker runs it) and that request's transfer then misbehaves as the file says:

    drop_done           every block lands, but the final "done" message is never sent
    fail_after_layer:N  layers after N fail with a transfer error (a break mid-request)
    delay_s:X           each send job waits X seconds first (a slow link: stage "transferring")

Fault-injection tests write the file, send one request, and watch it recover.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FAULT_FILE = os.environ.get("PDSERVE_FAULT_FILE") or None
KINDS = ("drop_done", "fail_after_layer", "delay_s")


@dataclass(frozen=True)
class Fault:
    kind: str
    value: float = 0.0


NO_FAULT = Fault("none")


def claim() -> Fault:
    """The pending fault, taken by this caller alone; NO_FAULT when there is none."""
    if FAULT_FILE is None:
        return NO_FAULT
    taken = f"{FAULT_FILE}.taken.{os.getpid()}.{time.monotonic_ns()}"
    try:
        os.rename(FAULT_FILE, taken)
    except OSError:
        return NO_FAULT
    with open(taken) as f:
        text = f.read().strip()
    kind, _, value = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown fault {text!r} in {FAULT_FILE}; choose one of {KINDS}")
    return Fault(kind, float(value or 0))


def layers_to_send(fault: Fault, layers: list[int]) -> tuple[list[int], str | None]:
    """The layers this job may send, and an error to raise after sending them (or None)."""
    if fault.kind == "delay_s":
        time.sleep(fault.value)
    if fault.kind == "fail_after_layer" and max(layers) > fault.value:
        kept = [layer for layer in layers if layer <= fault.value]
        return kept, f"injected fault: transfer failed after layer {int(fault.value)}"
    return layers, None
