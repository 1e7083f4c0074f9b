"""Arrival processes: when each session's first request is sent.

Open loop (``poisson``, ``gamma``, ``trace``): send times are fixed in advance and do not wait
for the server, which is what exposes queueing. Closed loop (``concurrency``): N users, each
sending its next session as soon as the previous one finished; it has no schedule.

Gamma inter-arrival times with shape ``burstiness`` and mean 1/rate (vLLM's convention):
burstiness 1 is Poisson, < 1 is burstier, > 1 is more regular.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("poisson", "gamma", "concurrency", "trace")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int = 0

    def __post_init__(self) -> None:
        if self.kind in ("poisson", "gamma") and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 (inf sends everything at once), got {self.rate}")
        if self.kind == "concurrency" and self.concurrency < 1:
            raise ValueError("--arrival concurrency needs --concurrency >= 1")

    def with_rate(self, rate: float) -> ArrivalSpec:
        return ArrivalSpec(self.kind, rate, self.burstiness, self.concurrency)


def arrival_times(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> list[float] | None:
    """Send offsets in seconds (first at 0) for ``n`` sessions; ``None`` for closed loop.

    ``trace`` returns ``None`` as well: the times come with the trace's sessions.
    """
    if spec.kind in ("concurrency", "trace"):
        return None
    if math.isinf(spec.rate):
        return [0.0] * n
    shape = 1.0 if spec.kind == "poisson" else spec.burstiness
    gaps = rng.gamma(shape, 1.0 / (spec.rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
