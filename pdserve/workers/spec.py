"""What one worker process is told at start: its role, engine settings, addresses. The
launcher writes it as JSON on the command line; the cluster secret travels separately, in
the environment (`pdserve.envs`), so it never shows in `ps`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass

from pdserve.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from pdserve.messages import ROLES
from pdserve.schema import check, from_dict, knob
from pdserve.transfer import KVTransferConfig

# A worker refreshes its Stats after a step at most this many times per heartbeat interval
# (workers/worker.py, `_maybe_stats`; the simulator's `SimWorker` refreshes alike).
STATS_PER_HEARTBEAT = 10


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str = knob(MISSING, choices=ROLES)
    engine: EngineConfig
    ctrl_address: str  # this worker's PULL socket (bound)
    router_address: str  # the router's PULL socket (connected)
    cpus: tuple[int, ...] = ()  # its cores at start, and the pool SetCores may choose from
    # Planned by the adaptive planner: reports its steps (StepReport), keeps its KV pool in
    # shared memory and both kernel sets, since any worker may prefill, decode or switch.
    adaptive: bool = False
    kv_transfer: KVTransferConfig = KVTransferConfig()  # with the transfer's deadlines
    transfer_host: str = "127.0.0.1"  # where a decode worker's KV receiver listens
    # prefill: the decode workers' KV dtype and model dtype (None: this worker's), converted to
    wire_kv_cache_dtype: str = knob("auto", choices=KV_CACHE_DTYPES)
    wire_dtype: str | None = knob(None, choices=DTYPES)
    # Seconds between Stats sends: the load the router routes by is up to this old (the
    # simulator models the same lag, `SimConfig.heartbeat_interval_s`).
    heartbeat_interval_s: float = knob(0.5, "seconds between a worker's Stats", gt=0)

    def __post_init__(self) -> None:
        check(self)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return from_dict(cls, json.loads(text), "--spec")
