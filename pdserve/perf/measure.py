"""`pdserve profile`: time the real engine on this machine over a grid of step shapes, fit
the step-cost model per thread count, measure KV transfer bandwidth and the serving stack's
own latency (through a real router and worker) and how served workers step against the fit
(under a load of requests: perf/served_steps.py), write the profile.

The engine runs on the cores a deployed worker of that size gets (the first `threads` cores,
every thread pinned as the worker pins them) and under a worker's OpenMP wait policy
(`timing_env`), so the steps are timed as a worker runs them.

The only perf module that loads torch (through the engine); the CLI imports it lazily.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from pdserve import envs
from pdserve.config import CacheConfig, EngineConfig
from pdserve.costmodel.profile import HardwareProfile, ModelShape
from pdserve.costmodel.step_cost import StepCostModel, StepShape, fit_cost_model, phase_ratios
from pdserve.engine.memory import DEFAULT_CPU_KV_FRACTION, meminfo_available_bytes
from pdserve.perf.machine import check_same_machine, cpu_name, shm_bandwidth, tcp_bandwidth
from pdserve.perf.served import served_overhead
from pdserve.perf.served_steps import measure_served_steps
from pdserve.schema import check, knob, same_as

if TYPE_CHECKING:
    from torch import nn

    from pdserve.engine.engine import Engine

# (prompt tokens, concurrent requests): single prompts of growing length give prefill steps
# (chunked past the threshold, so with prior context too); batches give decode steps. The
# lengths between 32 and 512 that are not powers of two are where chat prompts lie: without
# them the fit follows the many 512- and 2048-token steps the batches make, whose GEMMs run
# more efficiently per token, and prices a 200-token prefill low.
GRID = [
    (32, 1),
    (80, 1),
    (128, 1),
    (192, 1),
    (320, 1),
    (512, 1),
    (1024, 1),
    (2048, 1),
    (64, 4),
    (256, 4),
    (64, 16),
    (512, 8),
    (128, 32),
    (256, 32),
    (1024, 16),
]
KNEES = (16, 32, 64, 128, 256)
# The wake curve (`StepCostModel.wake`): a WAKE_PROMPT-token prefill timed after each pause
# with nothing to run, against one right after the last request (paired, WAKE_REPEATS each).
# A pause counts only where at least WAKE_MIN_SLOWER pairs were slower after it (a sign test:
# 1 in 128 by chance): on an AMD EPYC one thread's prefill jittered more than the effect, and
# the difference of medians read 0-15 ms out of order (0.01 s: 15 ms, 0.3 s: 0, 1 s: 14).
# 6 of 7 (8 in 128 by chance) still kept one such point in five pauses (0.03 s: 9.3 ms).
WAKE_PAUSES = (0.01, 0.03, 0.1, 0.3, 1.0)
WAKE_PROMPT = 128
WAKE_REPEATS = 7
WAKE_MIN_SLOWER = 7
# The speed probe (`pdserve profile --rescale`): prefills of chat lengths, a batched prefill,
# batch-1 and batch-4 decodes, PROBE_REPEATS timed passes after a warm-up (one pass left the
# median prefill ratio to three steps: ratios read 0.83-0.95 in one hour). Its baseline is
# the grid's own steps of these entries (each is one of GRID's), priced by the fit they are
# part of: it holds the fit's error at these shapes, and the machine's speed as the grid saw
# it. A probe timed once after the grid read the machine at one moment instead: on an AMD
# EPYC its prefill and decode steps ran 9% and 5% over the fit, the next probes 6% under
# that, so every rescaled profile of it ran ~6% fast (docs/simulator.md, "Profiles").
PROBE_GRID = ((128, 1), (320, 1), (64, 4))
PROBE_REPEATS = 3


def thread_counts(text: str) -> tuple[int, ...]:
    """'1,4' -> (1, 4)."""
    return tuple(int(t) for t in text.split(","))


@dataclass(frozen=True)
class ProfileConfig:
    """What `pdserve profile` measures; one flag per field (`schema.add_flags`)."""

    model: str = same_as(EngineConfig, "model")
    threads: tuple[int, ...] = knob(
        tuple(sorted({1, len(os.sched_getaffinity(0))})),
        "comma-separated thread counts to profile (one cost model each)",
        parse=thread_counts,
    )
    # None: the engine's default share of free memory
    kv_cache_bytes: int | None = same_as(CacheConfig, "kv_cache_bytes")
    decode_steps: int = knob(12, "tokens each grid request generates", ge=2)
    repeats: int = knob(2, "measured passes over the grid, after one warm-up pass", ge=1)
    served_requests: int = knob(
        20,
        "requests sent one at a time through a served collocated deployment to time the "
        "serving stack (HTTP, router, worker hops); 0: none, the profile's figures are 0 "
        "and no served steps are measured",
        ge=0,
    )
    grid: tuple[tuple[int, int], ...] = knob(tuple(GRID), cli=False)
    long_prompt_lens: tuple[int, ...] = knob(
        (),
        "comma-separated prompt lengths past the grid's 2,048, one request each, timed with "
        "the grid: a workload of longer prompts reaches contexts whose attention the fit would "
        "otherwise extrapolate (an 8,192-token prompt's chunks attend 16x the pairs of a "
        "2,048-token one's)",
        parse=thread_counts,
    )
    wake_pauses: tuple[float, ...] = knob(WAKE_PAUSES, cli=False)

    max_entry_tokens: int | None = knob(
        None,
        "leave out grid entries of more prompt tokens than this (prompt length x "
        "requests; the speed probe's are kept): (1024, 16) and (256, 32) hold 62%% of a pass's "
        "prompt tokens, for decode batches of 16-32 a workload of a few requests at a time "
        "never runs; 4096 keeps (512, 8)'s 2,048-token steps and (128, 32)'s batch of 32",
        gt=0,
    )

    def __post_init__(self) -> None:
        check(self)
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"threads must be positive integers, got {self.threads}")
        if self.long_prompt_lens and min(self.long_prompt_lens) < 1:
            raise ValueError(f"long_prompt_lens must be positive, got {self.long_prompt_lens}")

    @property
    def timed_grid(self) -> tuple[tuple[int, int], ...]:
        """The grid less its entries over `max_entry_tokens`, with the long prompts."""
        cap = self.max_entry_tokens or math.inf
        kept = [(n, r) for n, r in self.grid if n * r <= cap or (n, r) in PROBE_GRID]
        return (*kept, *((n, 1) for n in self.long_prompt_lens))


@dataclass
class Timings:
    """One thread count's measurements: `samples`, (shape, seconds) of every engine step over
    the grid after one warm-up pass; `wake`, the curve of `StepCostModel.wake`."""

    samples: list[tuple[StepShape, float]]
    wake: list[tuple[float, float]]
    probe: list[tuple[StepShape, float]]  # the samples of PROBE_GRID's entries
    entries: list[tuple[int, int]]  # each sample's grid entry
    row_kernel_rows: float = math.inf  # the engine's (StepCostModel.row_kernel_rows)


def measure_steps(cfg: ProfileConfig, threads: int) -> Timings:
    """Time the engine on the first `threads` cores: the grid, the wake curve."""
    entries: list[tuple[int, int]] = []
    with pinned_engine(cfg, threads) as engine:
        samples = time_grid(replace(cfg, grid=cfg.timed_grid), engine, entries)
        wake = _time_wake(cfg, engine)
        rows = row_kernel_rows(engine.runner.model)
    probe = [s for s, entry in zip(samples, entries, strict=True) if entry in PROBE_GRID]
    return Timings(samples, wake, probe, entries, rows)


def row_kernel_rows(model: nn.Module) -> float:
    """The most rows a step's linear layers run in row kernels, as the cost model's split
    (StepCostModel.row_kernel_rows): the `gemv_m_max` of the linears read in place from a
    GGUF that hold most of their bytes (on AMX builds weights without an integer dot product
    switch to tiles sooner than the rest). No such linears: infinite, one decode regime."""
    from pdserve.model.quant_linear import QuantLinear

    weight_bytes: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            rows = module.gemv_m_max
            weight_bytes[rows] = weight_bytes.get(rows, 0) + module.nbytes
    return float(max(weight_bytes, key=weight_bytes.get)) if weight_bytes else math.inf


def regimes(model: StepCostModel, engine_rows: float) -> str:
    """The fit's kernel regimes, and why one where the engine has two."""
    if math.isfinite(model.row_kernel_rows):
        return f"rows in row kernels up to {model.row_kernel_rows:g} a step, in tiles above"
    if math.isfinite(engine_rows):
        return (
            f"one kernel regime: the grid has no decode-only step over the engine's "
            f"{engine_rows:g} row-kernel rows (raise --max-entry-tokens)"
        )
    return "one kernel regime"


def entry_ratios(model: StepCostModel, timings: Timings) -> str:
    """Per grid entry, its steps' median measured over predicted: where the fit misses (one
    disturbed entry, or a kernel whose cost per row changes with the step's size)."""
    ratios: dict[tuple[int, int], list[float]] = {}
    for (shape, seconds), entry in zip(timings.samples, timings.entries, strict=True):
        ratios.setdefault(entry, []).append(seconds / model.predict(shape))
    return ", ".join(f"{n}x{r} x{statistics.median(v):.2f}" for (n, r), v in ratios.items())


def time_probe(
    cfg: ProfileConfig, threads: int, grid: tuple[tuple[int, int], ...] = PROBE_GRID
) -> list[tuple[StepShape, float]]:
    """The probe's `grid` on a fresh engine on the first `threads` cores, timed as the
    profile's grid is."""
    probe = replace(cfg, grid=grid, repeats=PROBE_REPEATS)
    with pinned_engine(probe, threads) as engine:
        return time_grid(probe, engine)


@contextmanager
def pinned_engine(cfg: ProfileConfig, threads: int) -> Iterator[Engine]:
    """An engine on the first `threads` cores (this process pinned there meanwhile)."""
    from pdserve.config import DeviceConfig
    from pdserve.engine.engine import Engine
    from pdserve.workers.cores import pin_threads

    config = EngineConfig(
        model=cfg.model,
        cache=CacheConfig(kv_cache_bytes=cfg.kv_cache_bytes, enable_prefix_caching=False),
        device=DeviceConfig(threads=threads),
    )
    cores = sorted(os.sched_getaffinity(0))
    if threads > len(cores):
        raise ValueError(f"threads {threads}: this process may run on {len(cores)} cores only")
    pin_threads(cores[:threads])
    try:
        yield Engine(config)
    finally:
        pin_threads(cores)


def time_grid(
    cfg: ProfileConfig, engine: Engine, entries: list[tuple[int, int]] | None = None
) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of each step over `cfg.grid`, `cfg.repeats` times after a warm-up
    pass; `entries`, when given, gets each sample's grid entry."""
    from pdserve.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    samples: list[tuple[StepShape, float]] = []
    # Greedy, as `pdserve bench` asks (the workloads `pdserve simulate` replays): sampling at
    # temperature 1 once added 1.2 ms per sequence to every step timed here.
    params = SamplingParams(max_tokens=cfg.decode_steps, temperature=0.0, ignore_eos=True)
    for rep in range(cfg.repeats + 1):
        for index, (prompt_len, num_requests) in enumerate(cfg.grid):
            for i in range(num_requests):
                prompt = rng.integers(0, vocab, size=prompt_len).tolist()
                engine.add_request(f"{rep}-{index}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
                if rep > 0:  # the first pass warms caches and kernels
                    samples.append((engine.last_shape, elapsed))
                    if entries is not None:
                        entries.append((prompt_len, num_requests))
    return samples


def _time_wake(cfg: ProfileConfig, engine: Engine) -> list[tuple[float, float]]:
    """(pause, extra seconds) per pause: the median over pairs of the prefill after that long
    idle less the one right after a request ended (paired, so drift cancels); 0 unless at
    least WAKE_MIN_SLOWER of the WAKE_REPEATS pairs were slower after the pause."""
    from pdserve.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def prefill_after(pause_s: float) -> float:
        time.sleep(pause_s)
        prompt = rng.integers(0, vocab, size=WAKE_PROMPT).tolist()
        engine.add_request(f"wake-{rng.integers(1 << 62)}", prompt, params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():  # its decode step: the next one starts hot
            engine.step()
        return elapsed

    prefill_after(0.0)
    curve = []
    for pause in cfg.wake_pauses:
        diffs = [prefill_after(pause) - prefill_after(0.0) for _ in range(WAKE_REPEATS)]
        curve.append((pause, wake_extra(diffs)))
    return curve


def wake_extra(diffs: list[float]) -> float:
    """One pause's point of the wake curve from its pairs' differences (after the pause less
    back to back): their median, or 0 unless (WAKE_MIN_SLOWER of WAKE_REPEATS) all were
    slower after the pause."""
    needed = math.ceil(len(diffs) * WAKE_MIN_SLOWER / WAKE_REPEATS)
    if sum(d > 0 for d in diffs) < needed:
        return 0.0
    return max(0.0, statistics.median(diffs))


def model_shape(name: str) -> ModelShape:
    from pdserve.model.config import ModelConfig
    from pdserve.model.registry import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(name, gguf_fp32_max_bytes=None))
    return ModelShape(
        name,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
        weight_bytes_per_param=4.0,
        kv_bytes_per_element=4.0,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def default_kv_cache_bytes() -> int:
    """What a CPU worker gets without --kv-cache-bytes (model_runner's default share)."""
    return int(meminfo_available_bytes() * DEFAULT_CPU_KV_FRACTION)


def timing_env() -> dict[str, str] | None:
    """Set a worker's OpenMP wait policy for this process (`envs.set_worker_thread_wait`) and
    return the variables in effect; None when torch (and so libgomp, which reads them once)
    was loaded before, so the steps are timed under whatever policy it loaded with.

    It matters on two or more threads: at a worker's 1,000 spins a 64-token prefill on two
    threads took 63 ms here against 43 ms at libgomp's default, which the profile once timed
    under, pricing an all-core worker's short prompts ~30% low (docs/simulator.md)."""
    if "torch" in sys.modules:
        return None
    envs.set_worker_thread_wait()
    return envs.thread_wait()


def build_profile(
    cfg: ProfileConfig, log=print, base: HardwareProfile | None = None
) -> HardwareProfile:
    """Measure `cfg.threads` and the served figures; with `base` (a profile of this machine),
    keep its cost models of other thread counts, its model and its KV size."""
    if missing := [entry for entry in PROBE_GRID if entry not in cfg.grid]:
        raise ValueError(f"grid: lacks the speed probe's entries {missing} (PROBE_GRID)")
    if base is not None:
        check_same_machine(base)
        kv_cache_bytes = int(base.kv_cache_bytes) if base.kv_cache_bytes else None
        cfg = replace(cfg, model=base.model.name, kv_cache_bytes=kv_cache_bytes)
    openmp = timing_env()
    if openmp is None:
        log(
            "torch was loaded before the profile could set a worker's OpenMP wait policy: "
            "steps are timed under this process's (`pdserve profile` sets a worker's)"
        )
    if cfg.kv_cache_bytes is None:
        cfg = replace(cfg, kv_cache_bytes=default_kv_cache_bytes())
    models = dict(base.models if base else {})
    probes = dict(base.machine.get("probe", {}) if base else {})
    for threads in cfg.threads:
        timings = measure_steps(cfg, threads)
        samples = timings.samples
        models[threads] = fit_cost_model(samples, KNEES, timings.row_kernel_rows)
        models[threads].wake = timings.wake
        prefill, decode = phase_ratios(models[threads], timings.probe)
        probes[str(threads)] = {
            "prefill": round(prefill, 4),
            "decode": round(decode, 4),
            "decode_steps": cfg.decode_steps,
            "shapes": [list(entry) for entry in PROBE_GRID],
        }
        errors = [abs(models[threads].predict(s) / t - 1) for s, t in samples]
        wake = ", ".join(f"{p:g} s: {x * 1e3:.1f} ms" for p, x in timings.wake)
        log(
            f"threads {threads}: {len(samples)} steps, fit error median "
            f"{np.median(errors):.1%}, p90 {np.percentile(errors, 90):.1%}; "
            f"{regimes(models[threads], timings.row_kernel_rows)}; a step after "
            f"idle costs more by {wake}; the speed probe's shapes in the grid: prefill steps "
            f"x{prefill:.3f} and decode steps x{decode:.3f} the fit's; measured over fitted "
            f"per entry (prompt x requests): {entry_ratios(models[threads], timings)}"
        )
    # A decode step of one request at context n, on one thread (the decode worker's start).
    one_thread = models.get(1)
    decode = one_thread and (lambda n: one_thread.predict(StepShape(0, 1, 0.0, n)))
    served = served_overhead(cfg.model, cfg.kv_cache_bytes, cfg.served_requests, decode)
    log(
        f"served: {served.request_s * 1e3:.1f} ms to the worker's step, "
        f"{served.token_s * 1e3:.1f} ms from its end per token, "
        f"{served.token_cpu_s * 1e3:.2f} ms of CPU per streamed token; a prefill worker's "
        f"first token {served.remote_token_s * 1e3:.1f} ms, the decode worker's start "
        f"{served.start_decode_s * 1e3:.1f} ms after it"
    )
    served_steps = dict(base.served_steps if base else {})
    if cfg.served_requests:
        measured = {threads: models[threads] for threads in cfg.threads}
        served_steps |= measure_served_steps(
            cfg.model, cfg.kv_cache_bytes, measured, served.token_cpu_s, log
        )
    cpu = cpu_name()
    kept = base and {
        "threads": sorted(set(models) - set(cfg.threads)),
        "measured_at": base.machine.get("measured_at"),
    }
    return HardwareProfile(
        kind="measured",
        device=f"cpu: {cpu}",
        model=model_shape(cfg.model),
        size_unit="threads",
        models=models,
        transfer={"tcp": tcp_bandwidth(), "shm": shm_bandwidth()},
        served=served,
        served_steps=served_steps,
        devices_per_node=len(os.sched_getaffinity(0)),
        kv_cache_bytes=cfg.kv_cache_bytes,
        machine={
            "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)),
            "host": platform.node(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "openmp_wait": openmp,  # the variables the steps were timed under; None: unknown
            # per thread count: the speed probe's steps over the fit's predictions, just after
            # the grid (what `--rescale` compares a later probe with)
            "probe": probes,
            # --update: the thread counts kept from the base profile, and when it was measured
            **({"kept": kept} if kept else {}),
        },
    )
