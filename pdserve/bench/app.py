"""From parsed flags to a finished result: build the plan once, run it against any URL.

Shared by ``bench`` (one URL) and ``bench compare`` (several deployments, same workload), so
both send byte-identical request streams for the same seed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.client import ClientConfig
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import RunConfig, RunResult, run_benchmark
from pdserve.bench.search import find_goodput, parse_scales, slo_scale_sweep
from pdserve.bench.tokens import TokenSource
from pdserve.bench.trace import TraceConfig, load_trace
from pdserve.bench.workloads import Session, WorkloadConfig, build_sessions, preset_lengths


@dataclass
class BenchPlan:
    """Everything a run needs except the URL, validated up front (ValueError names the flag)."""

    tokens: TokenSource
    sessions: list[Session]
    run: RunConfig
    slo: SLO
    scales: list[float]
    search: dict[str, float] | None
    config: dict[str, object]


def build_plan(args: argparse.Namespace, url: str | None = None) -> BenchPlan:
    """Parses flags into a plan; ``url`` overrides ``--url`` (compare sets it per deployment)."""
    text_prompts = args.prompt_format == "text" or args.endpoint == "chat"
    arrival_kind = "trace" if args.trace else args.arrival
    if args.trace and args.arrival not in ("poisson", "trace"):
        raise ValueError("--trace sets its own arrival times; drop --arrival")
    arrival = ArrivalSpec(arrival_kind, args.rate, args.burstiness, args.concurrency)
    client = ClientConfig(
        url=url or args.url or "",
        model=args.model or args.tokenizer,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout_s,
    )
    run = RunConfig(
        client=client,
        arrival=arrival,
        text_prompts=text_prompts,
        think_time_s=args.think_time_s,
        duration_s=args.duration_s,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        progress=not args.no_progress,
    )
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, getattr(args, "slo_itl_ms", None))
    scales = parse_scales(args.slo_scale) if args.slo_scale else []
    if (scales or args.find_goodput) and slo == SLO():
        raise ValueError(
            "--find-goodput and --slo-scale need --slo-ttft-ms, --slo-tpot-ms or --slo-itl-ms"
        )
    search = None
    if args.find_goodput:
        if arrival.kind not in ("poisson", "gamma"):
            raise ValueError("--find-goodput varies --rate, so it needs --arrival poisson or gamma")
        search = {
            "target": args.goodput_target,
            "start_rate": args.start_rate,
            "max_probes": args.max_probes,
        }
    tokens = TokenSource.load(args.tokenizer)
    sessions = _sessions(args, tokens, text_prompts)
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    config.update(url=client.url, model=client.model, text_prompts=text_prompts)
    return BenchPlan(tokens, sessions, run, slo, scales, search, config)


def _sessions(args: argparse.Namespace, tokens: TokenSource, text_prompts: bool) -> list[Session]:
    if args.trace:
        cfg = TraceConfig(
            path=args.trace,
            time_scale=args.trace_time_scale,
            length_scale=args.trace_length_scale,
            block_len=args.trace_block_len,
            max_requests=args.num_requests,
            text_prompts=text_prompts,
            seed=args.seed,
        )
        return load_trace(cfg, tokens)
    input_len, output_len = preset_lengths(args.preset) if args.preset else ("256", "128")
    cfg = WorkloadConfig(
        num_requests=args.num_requests,
        input_len=args.input_len or input_len,
        output_len=args.output_len or output_len,
        num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        text_prompts=text_prompts,
        seed=args.seed,
    )
    return build_sessions(cfg, tokens)


def execute(plan: BenchPlan, url: str | None = None) -> tuple[dict[str, object], RunResult]:
    """Runs the plan (with the goodput search if asked) and returns the result document.

    With ``--find-goodput`` the records and summary are those of the best passing probe
    (or of the last probe when none passed); every probe's summary is kept.
    """
    run_cfg = (
        plan.run if url is None else replace(plan.run, client=replace(plan.run.client, url=url))
    )
    document: dict[str, object] = {"config": plan.config}
    if plan.search is None:
        result = run_benchmark(plan.sessions, run_cfg, plan.tokens)
    else:
        results: dict[float, RunResult] = {}
        summaries = []

        def probe(rate: float) -> float:
            cfg = replace(run_cfg, arrival=run_cfg.arrival.with_rate(rate))
            results[rate] = run_benchmark(plan.sessions, cfg, plan.tokens)
            summary = results[rate].summary(plan.slo)
            summaries.append({"rate": rate, **summary})
            return float(summary["slo_attainment"])

        search = find_goodput(
            probe,
            target=plan.search["target"],
            start_rate=plan.search["start_rate"],
            max_probes=int(plan.search["max_probes"]),
        )
        best = search.best_rate if search.best_rate > 0 else search.probes[-1][0]
        result = results[best]
        document["goodput_search"] = {**search.to_dict(), "probe_summaries": summaries}
    document["summary"] = result.summary(plan.slo)
    if plan.scales:
        document["slo_scale"] = slo_scale_sweep(
            result.records, plan.slo, plan.scales, result.duration_s
        )
    document["records"] = [asdict(r) for r in result.records]
    return json_safe(document), result


def json_safe(value: object) -> object:
    """inf/nan -> None: strict JSON readers (jq, JavaScript) reject Python's NaN/Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
