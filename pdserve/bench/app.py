"""From parsed flags to a finished result: build the plan once, run it against any URL.

Shared by ``bench`` (one URL) and ``bench compare`` (several deployments, same workload), so
both send byte-identical request streams for the same seed.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.bench.arrivals import KINDS, ArrivalSpec
from pdserve.bench.client import ENDPOINTS, ClientConfig, wait_until_ready
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import RunConfig, RunResult, run_benchmark
from pdserve.bench.search import find_goodput, parse_scales, slo_scale_sweep
from pdserve.bench.tokens import TokenSource
from pdserve.bench.trace import MOONCAKE_BLOCK_LEN, TraceConfig, load_trace
from pdserve.bench.workloads import PRESETS, Session, WorkloadConfig, build_sessions
from pdserve.config import EngineConfig
from pdserve.schema import check, knob


@dataclass(frozen=True)
class BenchConfig:
    """Every flag of a benchmark run (`add_bench_arguments` derives them), grouped as target,
    workload, load, SLOs and search, output."""

    url: str | None = knob(None, "OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    model: str | None = knob(None, "model name sent in requests (default: --tokenizer)")
    tokenizer: str = knob(EngineConfig.model, "model name or directory with tokenizer.json")
    endpoint: str = knob("completions", "API to call", choices=tuple(ENDPOINTS))
    api_key: str | None = knob(None, "sent as 'Authorization: Bearer KEY'", repr=False)
    prompt_format: str = knob(
        "ids", "token-id prompts (exact lengths) or decoded text", choices=("ids", "text")
    )
    ignore_eos: bool = knob(True, "ask the server to generate past EOS")
    temperature: float = knob(0.0, "sampling temperature sent (0: greedy)", ge=0, le=2)
    logprobs: bool = knob(
        False, "ask each token's logprob: every token then streams in a chunk of its own"
    )
    request_timeout_s: float = knob(600.0, "one request, send to last token", gt=0)
    ready_timeout_s: float = knob(
        600.0, "wait up to this for GET /health to answer 200 before sending (0: no wait)", ge=0
    )

    preset: str | None = knob(None, "a workload's length shapes", choices=tuple(PRESETS))
    input_len: str | None = knob(None, "N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MAX]")
    output_len: str | None = knob(None, "same forms as --input-len")
    num_prefix_groups: int = knob(0, "groups sharing a system prompt of --prefix-len", ge=0)
    prefix_len: int = knob(0, "tokens of each group's shared system prompt", ge=0)
    num_turns: int = knob(1, "turns per conversation", ge=1)
    think_time_s: float = knob(0.0, "pause between a conversation's turns", ge=0)
    trace: str | None = knob(None, "JSONL trace (Mooncake format) to replay")
    trace_time_scale: float = knob(1.0, ">1 slows replay", gt=0)
    trace_length_scale: float = knob(1.0, "multiplies the trace's lengths", gt=0)
    trace_block_len: int = knob(MOONCAKE_BLOCK_LEN, "tokens per hash id", ge=1)
    seed: int = knob(0, "workload and arrival seed")

    arrival: str = knob("poisson", "arrival process", choices=KINDS)
    rate: float = knob(math.inf, "sessions/s (inf: all at once)")
    burstiness: float = knob(1.0, "gamma shape (1 = Poisson)", gt=0)
    concurrency: int = knob(0, "users for --arrival concurrency", ge=0)
    max_concurrency: int | None = knob(None, "cap on requests in flight", ge=1)
    num_requests: int = knob(100, "requests to send", ge=1)
    duration_s: float | None = knob(None, "stop sending after this long", gt=0)

    slo_ttft_ms: float | None = knob(None, "time-to-first-token target", gt=0)
    slo_tpot_ms: float | None = knob(None, "time-per-output-token target", gt=0)
    slo_itl_ms: float | None = knob(None, "per request: p99 of its inter-token gaps", gt=0)
    slo_max_gap_ms: float | None = knob(
        None, "per request: its longest inter-token gap (a stall budget)", gt=0
    )
    find_goodput: bool = knob(False, "search the highest rate with >= --goodput-target")
    goodput_target: float = knob(0.9, "SLO attainment the search needs", gt=0, le=1)
    start_rate: float = knob(1.0, "the search's first rate", gt=0)
    max_probes: int = knob(8, "runs the search may make", ge=1)
    slo_scale: str | None = knob(None, "comma-separated SLO factors, e.g. 0.5,1,2,4")

    output: str | None = knob(None, "result JSON: config, per-request records, summary")
    plot: str | None = knob(None, "directory for PNG figures (needs matplotlib)")
    progress: bool = knob(True, "progress bar on stderr")

    def __post_init__(self) -> None:
        check(self)


@dataclass
class BenchPlan:
    """Everything a run needs except the URL, validated up front (ValueError names the flag)."""

    tokens: TokenSource
    sessions: list[Session]
    run: RunConfig
    slo: SLO
    scales: list[float]
    search: dict[str, Any] | None  # find_goodput's arguments
    config: dict[str, object]


def build_plan(args: argparse.Namespace, url: str | None = None) -> BenchPlan:
    """Parses flags into a plan; ``url`` overrides ``--url`` (compare sets it per deployment)."""
    cfg = _part(BenchConfig, args)  # `args` may hold other subcommands' flags too
    text_prompts = cfg.prompt_format == "text" or cfg.endpoint == "chat"
    arrival_kind = "trace" if cfg.trace else cfg.arrival
    if cfg.trace and cfg.arrival not in ("poisson", "trace"):
        raise ValueError("--trace sets its own arrival times; drop --arrival")
    arrival = ArrivalSpec(arrival_kind, cfg.rate, cfg.burstiness, cfg.concurrency)
    client = _part(ClientConfig, cfg, url=url or cfg.url or "", model=cfg.model or cfg.tokenizer)
    run = _part(RunConfig, cfg, client=client, arrival=arrival, text_prompts=text_prompts)
    slo = SLO(cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_itl_ms, cfg.slo_max_gap_ms)
    scales = parse_scales(cfg.slo_scale) if cfg.slo_scale else []
    if (scales or cfg.find_goodput) and slo == SLO():
        raise ValueError(
            "--find-goodput and --slo-scale need --slo-ttft-ms, --slo-tpot-ms, --slo-itl-ms "
            "or --slo-max-gap-ms"
        )
    if cfg.find_goodput and arrival.kind not in ("poisson", "gamma"):
        raise ValueError("--find-goodput varies --rate, so it needs --arrival poisson or gamma")
    search = dict(target=cfg.goodput_target, start_rate=cfg.start_rate, max_probes=cfg.max_probes)
    tokens = TokenSource.load(cfg.tokenizer)
    sessions = _sessions(cfg, tokens, text_prompts)
    config = flag_config(args) | dict(url=client.url, model=client.model, text_prompts=text_prompts)
    return BenchPlan(
        tokens, sessions, run, slo, scales, search if cfg.find_goodput else None, config
    )


def _sessions(cfg: BenchConfig, tokens: TokenSource, text_prompts: bool) -> list[Session]:
    if cfg.trace:
        trace = (cfg.trace, cfg.trace_time_scale, cfg.trace_length_scale, cfg.trace_block_len)
        return load_trace(TraceConfig(*trace, cfg.num_requests, text_prompts, cfg.seed), tokens)
    input_len, output_len = PRESETS[cfg.preset] if cfg.preset else ("256", "128")
    workload = _part(
        WorkloadConfig,
        cfg,
        input_len=cfg.input_len or input_len,
        output_len=cfg.output_len or output_len,
        text_prompts=text_prompts,
    )
    return build_sessions(workload, tokens)


def _part(cls: type, cfg: object, **given: object) -> Any:
    """`cls` from `given` and, for its other fields, `cfg`'s attributes of the same name."""
    rest = {f.name: getattr(cfg, f.name) for f in fields(cls) if f.name not in given}
    return cls(**rest, **given)


def execute(
    plan: BenchPlan, url: str | None = None, run: Callable[[RunConfig], RunResult] | None = None
) -> tuple[dict[str, object], RunResult]:
    """Runs the plan (with the goodput search if asked) and returns the result document;
    ``run`` runs the plan's sessions under a RunConfig (default: against the server; the
    simulator passes its own).

    With ``--find-goodput`` the records and summary are those of the best passing probe
    (or of the last probe when none passed); every probe's summary is kept.
    """
    run_cfg = (
        plan.run if url is None else replace(plan.run, client=replace(plan.run.client, url=url))
    )
    served = run is None
    if served:
        wait_until_ready(run_cfg.client)
    run = run or (lambda cfg: run_benchmark(plan.sessions, cfg, plan.tokens))
    document: dict[str, object] = {"config": plan.config}
    if plan.search is None:
        cpu_s = time.process_time()
        result = run(run_cfg)
        if served:  # what this client's own CPU took from the machine it shares
            document["client_cpu_s"] = time.process_time() - cpu_s
    else:
        results: dict[float, RunResult] = {}
        summaries = []

        def probe(rate: float) -> float:
            results[rate] = run(replace(run_cfg, arrival=run_cfg.arrival.with_rate(rate)))
            summary = results[rate].summary(plan.slo)
            summaries.append({"rate": rate, **summary})
            return float(summary["slo_attainment"])

        search = find_goodput(probe, **plan.search)
        best = search.best_rate if search.best_rate > 0 else search.probes[-1][0]
        result = results[best]
        document["goodput_search"] = {**search.to_dict(), "probe_summaries": summaries}
    document["summary"] = result.summary(plan.slo)
    if plan.scales:
        document["slo_scale"] = slo_scale_sweep(
            result.records, plan.slo, plan.scales, result.duration_s
        )
    # Shallow: json_safe copies every list and dict (asdict deep-copied each gap of each
    # record on top, a tenth of a long simulated replay's time).
    document["records"] = [{f.name: getattr(r, f.name) for f in fields(r)} for r in result.records]
    return json_safe(document), result


def flag_config(args: argparse.Namespace) -> dict[str, object]:
    """The parsed flags, as a result document's "config"."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def json_safe(value: object) -> object:
    """inf/nan -> None: strict JSON readers (jq, JavaScript) reject Python's NaN/Infinity."""
    if isinstance(value, float):  # first: a result holds millions (every gap of every request)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        try:  # a list of finite numbers (a record's gaps) in one C-level pass
            if all(map(math.isfinite, value)):
                return list(value)
        except TypeError:  # something other than numbers in it
            pass
        return [json_safe(v) for v in value]
    return value
