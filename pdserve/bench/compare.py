"""``pdserve bench compare``: one workload, several deployments, one after the other.

Starting deployments is the launcher's job (only ``cluster`` starts processes), so it comes in
as a hook: ``launch(spec)`` is a context manager that brings a deployment up, yields its base
URL, and tears it down on exit (``cluster_launcher`` in ``pdserve/cluster/deployments.py``;
a spec that is a URL is yielded as it is).

SLOs must be equal across deployments for goodput to be comparable, so when none are given
they are derived once, from the *first* deployment's unloaded latency (sequential requests):
SLO = ``--slo-multiplier`` x its p50 TTFT / TPOT. Ratios in the table are against it as well.

Every deployment first answers ``--warmup-requests`` unloaded requests that are not measured
(as ``vllm bench serve --num-warmups``): a freshly started worker pays first-use costs (weight
pages, kernel buffers, allocator growth) on its first requests, and in a cell of a few requests
they would decide the result. Calibration requests count as warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TextIO

from pdserve.bench.app import build_plan, execute
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.metrics import SLO, fmt
from pdserve.schema import check, flag_values, from_flat, knob

Launch = Callable[[str], AbstractContextManager[str]]


@dataclass(frozen=True)
class CompareConfig:
    """The flags `bench compare` adds to the workload's."""

    deployment: tuple[str, ...] = knob(
        (),
        "NAME=SPEC, SPEC a server URL, collocated, NpMd (e.g. 1p1d), adaptive or a Pipeline "
        "YAML (default: collocated and 1p1d on the same cores)",
    )
    slo_multiplier: float = knob(
        5.0, "default SLOs = this x the first deployment's unloaded p50", gt=0
    )
    slo_itl_multiplier: float | None = knob(
        None,
        "p99 ITL SLO = this x the first deployment's unloaded p50 TPOT (a stall budget)",
        gt=0,
    )
    slo_max_gap_multiplier: float | None = knob(
        None,
        "longest-gap SLO = this x the first deployment's unloaded p50 TPOT (a freeze a "
        "reader sees, e.g. 10)",
        gt=0,
    )
    calibration_requests: int = knob(5, "unloaded requests the SLOs derive from", ge=1)
    warmup_requests: int = knob(
        1, "unloaded requests each deployment answers, not measured, before the workload", ge=0
    )

    def __post_init__(self) -> None:
        check(self)


def _unloaded(plan, url: str, num_requests: int) -> tuple[float, float]:
    """p50 TTFT and TPOT (ms) of requests sent one at a time: the no-queueing baseline."""
    sessions = [replace(s, turns=s.turns[:1], arrival_s=None) for s in plan.sessions[:num_requests]]
    run = replace(plan.run, arrival=ArrivalSpec("concurrency", concurrency=1), duration_s=None)
    calibration = replace(plan, sessions=sessions, run=run, slo=SLO(), scales=[], search=None)
    document, _ = execute(calibration, url)
    summary = document["summary"]
    if not summary["num_completed"]:
        raise ValueError(f"calibration against {url} failed: no request completed")
    return summary["ttft_ms"]["p50"], summary["tpot_ms"]["p50"] or 0.0


def run_compare(
    deployments: Mapping[str, str],
    workload_args: argparse.Namespace,
    launch: Launch,
    out: TextIO = sys.stdout,
) -> dict[str, dict[str, object]]:
    """Runs the same workload against each deployment in turn; prints and returns the table.

    ``deployments``: name -> spec handed to ``launch`` (a URL or a launcher config path).
    ``workload_args``: the ``bench`` flags (CompareConfig's read with defaults). Returns
    ``{name: {goodput, p90_ttft_ms, p90_tpot_ms, max_gap_ms, summary, records, ...}}``.
    """
    if not deployments:
        raise ValueError("compare needs at least one deployment")
    args = workload_args
    compare = from_flat(CompareConfig, flag_values(args, CompareConfig))
    multiplier, itl_multiplier = compare.slo_multiplier, compare.slo_itl_multiplier
    plan = build_plan(args, url="http://placeholder")
    # Calibration prompts come from another seed: re-sending the run's own prompts would
    # warm the first deployment's prefix cache and favour it.
    calibration_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1})
    calibration_plan = build_plan(calibration_args, url="http://placeholder")
    rows: dict[str, dict[str, object]] = {}
    for name, spec in deployments.items():
        with launch(spec) as url:
            calibrate = plan.slo.ttft_ms is None and plan.slo.tpot_ms is None
            if not calibrate and compare.warmup_requests:
                _unloaded(calibration_plan, url, compare.warmup_requests)
            if calibrate:
                ttft_ms, tpot_ms = _unloaded(calibration_plan, url, compare.calibration_requests)
                itl_ms, max_gap_ms = plan.slo.itl_ms, plan.slo.max_gap_ms
                if itl_multiplier and tpot_ms:
                    itl_ms = itl_multiplier * tpot_ms
                if compare.slo_max_gap_multiplier and tpot_ms:
                    max_gap_ms = round(compare.slo_max_gap_multiplier * tpot_ms, 1)
                tpot_slo_ms = multiplier * tpot_ms if tpot_ms else None
                slo = SLO(multiplier * ttft_ms, tpot_slo_ms, itl_ms, max_gap_ms)
                plan = replace(plan, slo=slo)
                print(
                    f"SLOs from {name} unloaded p50 x {multiplier:g}: TTFT {slo.ttft_ms:.1f}"
                    f" ms, TPOT {slo.tpot_ms or 0:.1f} ms"
                    + (f", p99 ITL {slo.itl_ms:.1f} ms" if slo.itl_ms else "")
                    + (f", max gap {slo.max_gap_ms:g} ms" if slo.max_gap_ms else ""),
                    file=out,
                )
            document, result = execute(plan, url)
            status = _status(url)
        summary = document["summary"]
        search = document.get("goodput_search")
        rows[name] = {
            "url": url,
            "goodput": search["best_rate"] if search else summary["goodput"],
            "goodput_kind": "max rate at target" if search else "req/s meeting SLOs",
            "p50_ttft_ms": summary["ttft_ms"]["p50"],
            "p90_ttft_ms": summary["ttft_ms"]["p90"],
            "p90_tpot_ms": summary["tpot_ms"]["p90"],
            "p99_itl_ms": summary["itl_ms"]["p99"],
            "max_gap_ms": summary["max_gap_ms"],
            "cache_hit_rate": summary.get("prefix_cache_hit_rate"),
            **plan.slo.result_fields(),
            "summary": summary,
            "records": document["records"],  # per request, as `pdserve bench --output` keeps
            "status": status,  # the router's /v1/status once the run is over (None: none)
        }
    print(format_table(rows), file=out)
    return rows


def _status(url: str) -> dict | None:
    """The server's `/v1/status` after a run (an adaptive router's recent decisions with their
    predictions, its targets, the workers' memory), or None where it has none: a peer server
    such as llama-server answers 404."""
    try:
        with urllib.request.urlopen(url + "/v1/status", timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _ratio(value: object, base: object) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base:
        return "-"
    return f"{value / base:.2f}x"


_COLUMNS = (
    ("goodput", "goodput", 10),
    ("p50_ttft_ms", "p50 TTFT ms", 14),
    ("p90_ttft_ms", "p90 TTFT ms", 14),
    ("p90_tpot_ms", "p90 TPOT ms", 14),
    ("p99_itl_ms", "p99 ITL ms", 14),
    ("max_gap_ms", "max gap ms", 14),
)


def format_table(rows: Mapping[str, Mapping[str, object]]) -> str:
    """Side-by-side goodput, p50/p90 TTFT, p90 TPOT, p99 ITL and the longest freeze (the
    largest gap between two tokens of any request), each with its ratio to the first row,
    and the share of prompt tokens the server reports as served from its prefix
    cache."""
    base = next(iter(rows.values()))
    titles = "".join(f"{title:>{width}}{'ratio':>8}" for _, title, width in _COLUMNS)
    lines = [f"{'deployment':<16}{titles}{'cached':>9}"]
    for name, row in rows.items():
        cells = "".join(
            f"{fmt(row.get(key), '.2f'):>{width}}{_ratio(row.get(key), base.get(key)):>8}"
            for key, _, width in _COLUMNS
        )
        lines.append(f"{name:<16}{cells}{fmt(row.get('cache_hit_rate'), '.1%'):>9}")
    return "\n".join(lines)
