"""What the simulator deploys: how many workers of each role, how big, with what limits.

Spec strings, as `pdserve bench compare` names deployments:

    collocated   one collocated worker
    Nc           N collocated workers (e.g. 2c)
    NpMd         N prefill and M decode workers (e.g. 1p1d, 3p5d)
    adaptive     one prefill and one decode worker sharing `collocated_size` cores, the
                 adaptive planner placing requests and moving cores (sim/adaptive.py)

A worker's size (threads on a CPU profile, tensor-parallel degree on a GPU one) comes per
role from `collocated_size`, `prefill_size`, `decode_size` (1 when not given).
`Deployment.on_host` is what `pdserve up` runs on a host of N cores, which `pdserve simulate`
takes by default on a CPU profile: the spec `up` picks without role counts (adaptive where
its two workers have a core each, else 1p1d), one collocated worker or the adaptive pool on
every core (as `up --collocated 1` runs it: torch's threads on every core), and several
workers one core each (as `up --pin-cpus` and `bench compare` start them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.planner.config import AdaptiveConfig
from pdserve.router.config import RouterConfig
from pdserve.schema import check, knob, same_as
from pdserve.workers.spec import WorkerSpec


@dataclass(frozen=True)
class Deployment:
    # The sizes are `pdserve simulate` flags; the counts come from the --deployment spec.
    num_collocated: int = knob(0, ge=0, cli=False)
    num_prefill: int = knob(0, ge=0, cli=False)
    num_decode: int = knob(0, ge=0, cli=False)
    # None: 1 here; `pdserve simulate` gives what `up` would (`on_host`).
    collocated_size: int | None = knob(
        None,
        "devices per worker (adaptive: the pool its two workers share; default: what pdserve "
        "up gives it on the profile's host)",
        ge=1,
    )
    prefill_size: int | None = knob(None, "devices per prefill worker (default: 1)", ge=1)
    decode_size: int | None = knob(None, "devices per decode worker (default: 1)", ge=1)
    # num_prefill + num_decode workers share one pool of cores
    adaptive: bool = knob(False, cli=False)

    def __post_init__(self) -> None:
        check(self)
        for name in ("collocated_size", "prefill_size", "decode_size"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, 1)
        if self.num_collocated and (self.num_prefill or self.num_decode):
            raise ValueError("a deployment is collocated or disaggregated, not both")
        if not self.num_collocated and not (self.num_prefill and self.num_decode):
            raise ValueError("a disaggregated deployment needs >= 1 prefill and >= 1 decode worker")

    @classmethod
    def parse(cls, spec: str, **sizes: int) -> Deployment:
        """`spec` (module docstring) with `collocated_size`, `prefill_size`, `decode_size`."""
        if spec == "collocated":
            return cls(num_collocated=1, **sizes)
        if match := re.fullmatch(r"(\d+)c", spec):
            return cls(num_collocated=int(match[1]), **sizes)
        if match := re.fullmatch(r"(\d+)p(\d+)d", spec):
            return cls(num_prefill=int(match[1]), num_decode=int(match[2]), **sizes)
        if spec == "adaptive":
            pool = sizes.get("collocated_size", 1)
            if pool < 2:
                raise ValueError("deployment 'adaptive' shares --collocated-size cores: needs >= 2")
            return cls(
                num_prefill=1,
                num_decode=1,
                prefill_size=pool,
                decode_size=pool,
                collocated_size=pool,
                adaptive=True,
            )
        raise ValueError(
            f"unknown deployment {spec!r}: use collocated, Nc (e.g. 2c), NpMd or adaptive"
        )

    @classmethod
    def on_host(cls, spec: str | None, cores: int, **sizes: int) -> Deployment:
        """What `pdserve up` runs on a host of `cores` cores (module docstring): `spec`, or
        up's default when None; `sizes` given replace the ones up would choose."""
        if spec is None:  # cluster/up.py, `default_is_adaptive`
            spec = "adaptive" if cores >= AdaptiveConfig().workers else "1p1d"
        if spec in ("collocated", "adaptive"):
            sizes = {"collocated_size": cores, **sizes}
        return cls.parse(spec, **sizes)

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
        return (
            f"{self.num_prefill} prefill x{self.prefill_size} + "
            f"{self.num_decode} decode x{self.decode_size}"
        )


@dataclass(frozen=True)
class SimConfig:
    """How every simulated worker is set up, as `pdserve up` would set up the real ones; one
    `pdserve simulate` / `plan` flag per field (`--max-num-seqs`, `--no-prefix-caching`)."""

    scheduler: SchedulerConfig = SchedulerConfig()
    block_size: int = same_as(CacheConfig, "block_size")
    enable_prefix_caching: bool = same_as(CacheConfig, "enable_prefix_caching")
    # The router's policies and defaults (RouterConfig): the simulator runs what `up` runs.
    routing: str = same_as(RouterConfig, "policy")
    load_balancer: str = same_as(RouterConfig, "load_balancer")
    transfer_backend: str | None = knob(None, "a backend the profile measured (default: first)")
    kv_cache_bytes: float | None = knob(None, "per worker (default: the profile's)", gt=0)
    # The router routes by each worker's last Stats (SimWorker.report), as the real one does.
    heartbeat_interval_s: float = same_as(WorkerSpec, "heartbeat_interval_s")

    def __post_init__(self) -> None:
        check(self)
