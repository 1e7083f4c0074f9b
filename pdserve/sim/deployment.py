"""What the simulator deploys: how many workers of each role, how big, with what limits.

Spec strings, as `pdserve bench compare` names deployments:

    collocated   one collocated worker
    Nc           N collocated workers (e.g. 2c)
    NpMd         N prefill and M decode workers (e.g. 1p1d, 3p5d)
    adaptive     one prefill and one decode worker sharing `collocated_size` cores, the
                 adaptive planner placing requests and moving cores (sim/adaptive.py)

A worker's size (threads on a CPU profile, tensor-parallel degree on a GPU one) comes per
role from `collocated_size`, `prefill_size`, `decode_size`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig


@dataclass(frozen=True)
class Deployment:
    num_collocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    collocated_size: int = 1
    prefill_size: int = 1
    decode_size: int = 1
    adaptive: bool = False  # num_prefill + num_decode workers share one pool of cores

    def __post_init__(self) -> None:
        for name in ("num_collocated", "num_prefill", "num_decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("collocated_size", "prefill_size", "decode_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_collocated and (self.num_prefill or self.num_decode):
            raise ValueError("a deployment is collocated or disaggregated, not both")
        if not self.num_collocated and not (self.num_prefill and self.num_decode):
            raise ValueError("a disaggregated deployment needs >= 1 prefill and >= 1 decode worker")

    @classmethod
    def parse(cls, spec: str, collocated_size: int = 1, prefill_size: int = 1,
              decode_size: int = 1) -> Deployment:  # fmt: skip
        sizes = dict(collocated_size=collocated_size, prefill_size=prefill_size,
                     decode_size=decode_size)  # fmt: skip
        if spec == "collocated":
            return cls(num_collocated=1, **sizes)
        if match := re.fullmatch(r"(\d+)c", spec):
            return cls(num_collocated=int(match[1]), **sizes)
        if match := re.fullmatch(r"(\d+)p(\d+)d", spec):
            return cls(num_prefill=int(match[1]), num_decode=int(match[2]), **sizes)
        if spec == "adaptive":
            if collocated_size < 2:
                raise ValueError("deployment 'adaptive' shares --collocated-size cores: needs >= 2")
            pool = collocated_size
            return cls(num_prefill=1, num_decode=1, prefill_size=pool, decode_size=pool,
                       collocated_size=pool, adaptive=True)  # fmt: skip
        raise ValueError(
            f"unknown deployment {spec!r}: use collocated, Nc (e.g. 2c), NpMd or adaptive"
        )

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_devices(self) -> int:
        if self.adaptive:
            return self.collocated_size
        return (
            self.num_collocated * self.collocated_size
            + self.num_prefill * self.prefill_size
            + self.num_decode * self.decode_size
        )

    def workers(self) -> list[tuple[str, str, int]]:
        """(worker id, role, size) of every worker."""
        out = [(f"c{i}", "collocated", self.collocated_size) for i in range(self.num_collocated)]
        out += [(f"p{i}", "prefill", self.prefill_size) for i in range(self.num_prefill)]
        out += [(f"d{i}", "decode", self.decode_size) for i in range(self.num_decode)]
        return out

    def describe(self) -> str:
        if self.adaptive:
            return f"adaptive: 1 prefill + 1 decode sharing {self.collocated_size}"
        if not self.is_disaggregated:
            return f"{self.num_collocated} collocated x{self.collocated_size}"
        return (f"{self.num_prefill} prefill x{self.prefill_size} + "
                f"{self.num_decode} decode x{self.decode_size}")  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    """How every simulated worker is set up, as `pdserve up` would set up the real ones."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    enable_prefix_caching: bool = True
    routing: str = "shortest_queue"
    load_balancer: str | None = None
    transfer_backend: str | None = None  # None: the profile's first
    kv_cache_bytes: float | None = None  # per worker; None: the profile's capacity
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
