"""``pdserve bench``: flags, the run, and what is printed and written.

``add_bench_parser(subparsers)`` registers the subcommand on the top-level ``pdserve`` parser;
``python -m pdserve.bench`` uses ``build_parser()`` stand-alone. Bad input ends with one line
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from pdserve.bench.app import BenchConfig, build_plan, execute, flag_config, json_safe
from pdserve.bench.compare import CompareConfig, Launch, run_compare
from pdserve.bench.metrics import SLO, RequestRecord, format_summary
from pdserve.schema import OneLineArgumentParser, add_flags


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `BenchConfig` field, every one present in the parsed args; shared by
    ``bench``, ``bench compare``, ``simulate`` and ``plan``."""
    add_flags(parser, BenchConfig, **{f.name: f.default for f in fields(BenchConfig)})


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``bench`` (and ``bench compare``); the parser's ``func`` is ``main``."""
    summary = "serving benchmark against any OpenAI-compatible endpoint"
    return _configure(subparsers.add_parser("bench", help=summary))


def build_parser() -> argparse.ArgumentParser:
    description = "Serving benchmark for OpenAI-compatible endpoints."
    return _configure(OneLineArgumentParser(prog="pdserve bench", description=description))


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_bench_arguments(parser)
    sub = parser.add_subparsers(
        dest="bench_command", metavar="{compare}", parser_class=OneLineArgumentParser
    )
    summary = "same workload against several deployments, side by side"
    compare = sub.add_parser("compare", help=summary)
    add_bench_arguments(compare)
    add_flags(compare, CompareConfig, deployment=[])
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace, launch: Launch | None = None) -> int:
    """Runs ``bench`` or ``bench compare``; returns the exit code.

    ``launch`` is the hook that brings up ``compare`` deployments (see
    ``pdserve.bench.compare.run_compare``); by default the cluster launcher.
    """
    try:
        if getattr(args, "bench_command", None) == "compare":
            from pdserve.cluster.deployments import DEFAULT_DEPLOYMENTS, cluster_launcher

            deployments = _parse_deployments(args.deployment or []) or dict(DEFAULT_DEPLOYMENTS)
            launch = launch or cluster_launcher(args.model or args.tokenizer)
            rows = run_compare(deployments, args, launch)
            if args.output:
                _write_json(args.output, json_safe({"config": flag_config(args), "compare": rows}))
            return 0
        if not args.url:
            raise ValueError("--url is required")
        plan = build_plan(args)
        document, result = execute(plan)
        report(args, document, result.records, plan.slo)
    except (ValueError, OSError) as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
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


def _write_json(path: str, document: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1))


def report(
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
            args.plot,
            records,
            slo.ttft_ms,
            slo.tpot_ms,
            probes,
            document.get("slo_scale", []),
            args.goodput_target,
        )
