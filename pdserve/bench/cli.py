"""``pdserve bench``: flags, the run, and what is printed and written.

``add_bench_parser(subparsers)`` registers the subcommand on the top-level ``pdserve`` parser;
``python -m pdserve.bench`` uses ``build_parser()`` stand-alone. Bad input ends with one line
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pdserve.bench.arrivals import KINDS
from pdserve.bench.client import ENDPOINTS
from pdserve.bench.compare import Launch, run_compare
from pdserve.bench.metrics import SLO, RequestRecord, format_summary
from pdserve.bench.workloads import PRESETS
from pdserve.config import EngineConfig
from pdserve.schema import OneLineArgumentParser


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Every workload/run flag; shared by ``bench`` and ``bench compare``."""
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="model name sent in requests (default: --tokenizer)")
    target.add_argument(
        "--tokenizer",
        default=EngineConfig.model,
        help="model name or directory with tokenizer.json",
    )
    target.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="token-id prompts (exact lengths) or decoded text",
    )
    target.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    target.add_argument("--request-timeout-s", type=float, default=600.0)

    work = parser.add_argument_group("workload")
    work.add_argument("--preset", choices=list(PRESETS))
    work.add_argument("--input-len", help="N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MAX]")
    work.add_argument("--output-len", help="same forms as --input-len")
    work.add_argument(
        "--num-prefix-groups",
        type=int,
        default=0,
        help="groups sharing a system prompt of --prefix-len tokens",
    )
    work.add_argument("--prefix-len", type=int, default=0)
    work.add_argument("--num-turns", type=int, default=1, help="turns per conversation")
    work.add_argument("--think-time-s", type=float, default=0.0)
    work.add_argument("--trace", help="JSONL trace (Mooncake format) to replay")
    work.add_argument("--trace-time-scale", type=float, default=1.0, help=">1 slows replay")
    work.add_argument("--trace-length-scale", type=float, default=1.0)
    work.add_argument("--trace-block-len", type=int, default=512, help="tokens per hash id")
    work.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--arrival", choices=list(KINDS), default="poisson")
    load.add_argument("--rate", type=float, default=math.inf, help="sessions/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    load.add_argument("--concurrency", type=int, default=0, help="users for --arrival concurrency")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--num-requests", type=int, default=100)
    load.add_argument("--duration-s", type=float, help="stop sending after this long")

    slo = parser.add_argument_group("SLOs and search")
    slo.add_argument("--slo-ttft-ms", type=float)
    slo.add_argument("--slo-tpot-ms", type=float)
    slo.add_argument("--slo-itl-ms", type=float, help="per request: p99 of its inter-token gaps")
    slo.add_argument(
        "--find-goodput",
        action="store_true",
        help="search the highest rate with >= --goodput-target attainment",
    )
    slo.add_argument("--goodput-target", type=float, default=0.9)
    slo.add_argument("--start-rate", type=float, default=1.0)
    slo.add_argument("--max-probes", type=int, default=8)
    slo.add_argument("--slo-scale", help="comma-separated SLO factors, e.g. 0.5,1,2,4")

    out = parser.add_argument_group("output")
    out.add_argument("--output", help="result JSON: config, per-request records, summary")
    out.add_argument("--plot", help="directory for PNG figures (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_compare(subparsers: argparse._SubParsersAction) -> None:
    compare = subparsers.add_parser(
        "compare", help="same workload against several deployments, side by side"
    )
    add_bench_arguments(compare)
    compare.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a server URL, collocated, NpMd (e.g. 1p1d) or a Pipeline YAML; repeatable "
        "(default: collocated and 1p1d on the same cores)",
    )
    compare.add_argument(
        "--slo-multiplier",
        type=float,
        default=5.0,
        help="default SLOs = this x the first deployment's unloaded p50",
    )
    compare.add_argument(
        "--slo-itl-multiplier",
        type=float,
        help="p99 ITL SLO = this x the first deployment's unloaded p50 TPOT (a stall budget)",
    )
    compare.add_argument("--calibration-requests", type=int, default=5)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``bench`` (and ``bench compare``); the parser's ``func`` is ``main``."""
    parser = subparsers.add_parser(
        "bench", help="serving benchmark against any OpenAI-compatible endpoint"
    )
    _configure(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="pdserve bench", description="Serving benchmark for OpenAI-compatible endpoints."
    )
    _configure(parser)
    return parser


def _configure(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)
    sub = parser.add_subparsers(
        dest="bench_command", metavar="{compare}", parser_class=OneLineArgumentParser
    )
    _add_compare(sub)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace, launch: Launch | None = None) -> int:
    """Runs ``bench`` or ``bench compare``; returns the exit code.

    ``launch`` is the hook that brings up ``compare`` deployments (see
    ``pdserve.bench.compare.run_compare``); by default the cluster launcher.
    """
    from pdserve.bench.app import build_plan, execute, json_safe

    try:
        if getattr(args, "bench_command", None) == "compare":
            deployments = _parse_deployments(args.deployment) if args.deployment else None
            if deployments is None:
                from pdserve.cluster.deployments import DEFAULT_DEPLOYMENTS

                deployments = dict(DEFAULT_DEPLOYMENTS)
            if launch is None:
                from pdserve.cluster.deployments import cluster_launcher

                launch = cluster_launcher(args.model or args.tokenizer)
            rows = run_compare(deployments, args, launch)
            if args.output:
                _write_json(args.output, json_safe({"config": _config(args), "compare": rows}))
            return 0
        if not args.url:
            raise ValueError("--url is required")
        plan = build_plan(args)
        document, result = execute(plan)
        _report(args, document, result.records, plan.slo)
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130
    return 0


def _parse_deployments(specs: list[str]) -> dict[str, str]:
    deployments: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"--deployment {spec!r}: expected NAME=URL or NAME=CONFIG")
        if name in deployments:
            raise ValueError(f"--deployment {name!r} given twice")
        deployments[name] = value
    return deployments


def _config(args: argparse.Namespace) -> dict[str, object]:
    return {k: v for k, v in vars(args).items() if not callable(v)}


def _write_json(path: str, document: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1))


def _report(
    args: argparse.Namespace, document: dict, records: list[RequestRecord], slo: SLO
) -> None:

    print(format_summary(document["summary"]))
    search = document.get("goodput_search")
    if search:
        print(f"{'max rate with >= target attainment':<40}{search['best_rate']:.3g} req/s")
    for row in document.get("slo_scale", []):
        print(f"{'SLO x ' + format(row['scale'], 'g') + ' attainment':<40}{row['attainment']:.3f}")
    if args.output:
        _write_json(args.output, document)
    if args.plot:
        from pdserve.bench.plots import write_plots

        probes = [(p["rate"], p["attainment"]) for p in (search or {}).get("probes", [])]
        write_plots(
            args.plot, records, slo.ttft_ms, slo.tpot_ms, probes,
            document.get("slo_scale", []), args.goodput_target,
        )  # fmt: skip
