"""What one worker process is told at start: its role, engine settings, addresses. The
launcher writes it as JSON on the command line; the cluster secret travels separately, in
an environment variable, so it never shows in `ps`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.kvstore.config import KVStoreConfig

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str
    engine: EngineConfig
    ctrl_address: str  # this worker's PULL socket (bound)
    router_address: str  # the router's PULL socket (connected)
    cpus: tuple[int, ...] = ()
    transfer_backend: str = "auto"
    transfer_mode: str = "layerwise"
    transfer_host: str = "127.0.0.1"  # where a decode worker's KV receiver listens
    transfer_buffer_bytes: int = 64 * 2**20
    transfer_bandwidth: str | None = None
    wire_kv_cache_dtype: str = "auto"  # prefill: the decode workers' KV dtype (converted to)
    heartbeat_interval_s: float = 0.5
    # Deadlines on waits for a peer (engine/roles/ says which wait each bounds).
    kv_send_timeout_s: float = 5.0
    kv_reserve_timeout_s: float = 600.0  # see engine/roles/decode.py
    kv_land_timeout_s: float = 5.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        e = data.pop("engine")
        engine = EngineConfig(
            model=e["model"],
            cache=CacheConfig(**e["cache"]),
            scheduler=SchedulerConfig(**e["scheduler"]),
            device=DeviceConfig(**e["device"]),
            kvstore=KVStoreConfig(**e["kvstore"]),
            seed=e["seed"],
        )
        return cls(engine=engine, **{k: tuple(v) if k == "cpus" else v for k, v in data.items()})


def read_secret() -> bytes:
    value = os.environ.get(SECRET_ENV)
    if not value:
        raise ValueError(f"{SECRET_ENV} is not set: workers need the cluster secret")
    return bytes.fromhex(value)
