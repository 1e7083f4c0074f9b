"""The router's configuration: one frozen dataclass, validated on construction.

The launcher writes it as JSON (`--config-json`); the cluster secret never travels in the JSON
(it would show in `ps`), it arrives hex-encoded in PDSERVE_CLUSTER_SECRET, read in `main.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "collocated")
POLICIES = ("round_robin", "shortest_queue", "prefix_cache")


@dataclass(frozen=True)
class WorkerEndpoint:
    """A worker the router sends to: its id (as in its Ready), role and PULL address."""

    worker_id: str
    role: str
    address: str

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("workers[].worker_id must be a non-empty string")
        if self.role not in ROLES:
            raise ValueError(f"workers[].role must be one of {ROLES}, got {self.role!r}")
        if not self.address:
            raise ValueError(f"workers[{self.worker_id}].address must be a ZMQ address")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m"  # the served name: what clients pass as `model`
    model_path: str = ""  # tokenizer source (known name, .gguf, HF or tokenizer dir); "" = model
    ctrl_address: str = "tcp://127.0.0.1:5600"  # the router's PULL socket (bound here)
    workers: tuple[WorkerEndpoint, ...] = ()
    secret: bytes = field(default=b"", repr=False)
    policy: str = "prefix_cache"  # picks prefill / collocated workers
    load_balancer: str = "shortest_queue"  # picks decode workers
    api_key: str | None = field(default=None, repr=False)
    heartbeat_timeout_s: float = 3.0
    admission_timeout_s: float = 10.0
    warmup_timeout_s: float = 600.0  # one warm-up prefill (a long prompt on a CPU core)
    max_recoveries: int = 3  # re-drives of one request after worker failures, then 502
    max_pending: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    max_tokens_limit: int = 1 << 20  # larger max_tokens are rejected as a typo, not clamped
    # What one request may ask of the router's event loop (README "Security model"). Every
    # stop string is searched for after every token, so their count and length bound that work.
    max_num_stop: int = 16  # entries in `stop` and in `stop_token_ids` (OpenAI allows 4)
    max_stop_len: int = 256  # characters in one stop string
    # Slow clients. aiohttp's keep-alive timer runs from connect (and from each response) to
    # the next complete request head, so it bounds idle and dribbled heads alike.
    head_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # complete head -> complete body; a request slot waits for it
    write_timeout_s: float = 30.0  # longest a client may leave a response chunk unread
    protect_health_metrics: bool = False  # /health and /metrics need api_key too
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(_endpoint(w) for w in self.workers))
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not self.model:
            raise ValueError("model must be a non-empty served model name")
        for name in ("policy", "load_balancer"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        timeouts = ("heartbeat_timeout_s", "admission_timeout_s", "warmup_timeout_s")
        for name in (*timeouts, "head_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.max_recoveries, bool) or not isinstance(self.max_recoveries, int):
            raise ValueError(f"max_recoveries must be an integer, got {self.max_recoveries!r}")
        if self.max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0, got {self.max_recoveries}")
        limits = ("max_pending", "max_body_bytes", "max_tokens_limit")
        for name in (*limits, "max_num_stop", "max_stop_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.protect_health_metrics and not self.api_key:
            raise ValueError("protect_health_metrics needs api_key: there is nothing to check")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workers: duplicate worker_id in {ids}")

    @property
    def tokenizer_source(self) -> str:
        return self.model_path or self.model

    @classmethod
    def from_dict(cls, data: dict[str, Any], secret: bytes = b"") -> RouterConfig:
        """A config from parsed JSON; unknown keys are an error naming them (typos fail loud)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"secret"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown router config field(s): {', '.join(unknown)}")
        return cls(**data, secret=secret)


def _endpoint(value: WorkerEndpoint | dict[str, Any]) -> WorkerEndpoint:
    if isinstance(value, WorkerEndpoint):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"workers[] must be objects with worker_id, role, address: {value!r}")
    try:
        return WorkerEndpoint(**value)
    except TypeError as exc:
        raise ValueError(f"workers[]: {exc}") from None
