"""PNG figures from a result: latency CDFs and SLO attainment vs rate / SLO scale.

matplotlib is imported inside ``write_plots`` with the Agg backend: it is a dev extra, the
benchmark must run without it, and no display exists on a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.metrics import RequestRecord


def _cdf(ax, values_ms: Sequence[float], title: str, slo_ms: float | None) -> None:
    ordered = sorted(values_ms)
    if ordered:
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, ys, where="post")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)


def write_plots(
    out_dir: str,
    records: Sequence[RequestRecord],
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    goodput_probes: Sequence[tuple[float, float]] = (),
    scale_rows: Sequence[dict] = (),
    target: float = 0.9,
) -> list[Path]:
    """Writes the figures that have data and returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    paths = []

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    _cdf(axes[0], [r.ttft_s * 1e3 for r in done if r.ttft_s is not None], "TTFT", slo_ttft_ms)
    tpots = [t * 1e3 for r in done if (t := r.tpot_s) is not None]
    _cdf(axes[1], tpots, "TPOT", slo_tpot_ms)
    _cdf(axes[2], [g * 1e3 for r in done for g in r.itl_s], "inter-token latency", None)
    _cdf(axes[3], [r.e2e_s * 1e3 for r in done if r.e2e_s is not None], "end-to-end", None)
    fig.suptitle(f"{len(done)} of {len(records)} requests completed")
    fig.tight_layout()
    paths.append(out / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    scale_points = [(row["scale"], row["attainment"]) for row in scale_rows]
    curves = [
        ("attainment_vs_rate.png", sorted(goodput_probes), "request rate (req/s)"),
        ("attainment_vs_slo_scale.png", scale_points, "SLO scale"),
    ]
    for name, points, xlabel in curves:
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in points], [p[1] * 100 for p in points], marker="o")
        ax.axhline(target * 100, color="red", linestyle="--", label=f"{target:.0%} target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
