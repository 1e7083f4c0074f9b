"""The two axes of DistServe's evaluation: highest rate meeting the SLOs, and SLO scale.

``find_goodput`` takes the probe as a callable (rate -> attainment) so the search logic is
tested without a server and the same search serves ``bench`` and ``bench compare``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import SLO, RequestRecord, attainment, goodput


@dataclass
class GoodputSearch:
    """``best_rate``: highest probed rate whose attainment reached the target (0 if none)."""

    target: float
    best_rate: float = 0.0
    probes: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "target_attainment": self.target,
            "best_rate": self.best_rate,
            "probes": [{"rate": r, "attainment": a} for r, a in self.probes],
        }


def find_goodput(
    probe: Callable[[float], float],
    target: float = 0.9,
    start_rate: float = 1.0,
    max_probes: int = 8,
    rel_tol: float = 0.05,
) -> GoodputSearch:
    """Exponential search to bracket the knee, then bisection, in at most ``max_probes`` runs.

    Assumes attainment falls as rate rises (true for a queueing system; noise can break it,
    which is why the result is the best rate *observed* to pass, never an interpolation).
    """
    search = GoodputSearch(target)

    def passes(rate: float) -> bool:
        value = probe(rate)
        search.probes.append((rate, value))
        if value >= target:
            search.best_rate = max(search.best_rate, rate)
            return True
        return False

    rate = start_rate
    up = passes(rate)  # passing: double until a rate fails; failing: halve until one passes
    lo, hi = (rate, 0.0) if up else (0.0, rate)
    while (hi if up else lo) == 0.0 and len(search.probes) < max_probes:
        rate = rate * 2 if up else rate / 2
        lo, hi = (rate, hi) if passes(rate) else (lo, rate)
    while lo > 0 and hi > 0 and len(search.probes) < max_probes and hi / lo > 1 + rel_tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return search


def parse_scales(spec: str) -> list[float]:
    """``"0.5,1,2"`` -> [0.5, 1.0, 2.0]; every factor must be positive."""
    try:
        scales = [float(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--slo-scale {spec!r}: expected comma-separated numbers") from None
    if not scales or any(s <= 0 for s in scales):
        raise ValueError(f"--slo-scale {spec!r}: factors must be > 0")
    return scales


def slo_scale_sweep(
    records: Sequence[RequestRecord], slo: SLO, scales: Sequence[float], duration_s: float
) -> list[dict[str, float | None]]:
    """Attainment and goodput of one run with every SLO multiplied by each factor.

    One run suffices: scaling the SLO changes which requests pass, not what they measured.
    """
    return [
        {
            "scale": scale,
            **scaled.result_fields(),
            "attainment": attainment(records, scaled),
            "goodput": goodput(records, scaled, duration_s),
        }
        for scale, scaled in ((factor, slo.scaled(factor)) for factor in scales)
    ]
