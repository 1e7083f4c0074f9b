"""`pdserve profile --rescale PROFILE`: the profile at this machine's speed now.

A profile's grid takes half an hour on a slow CPU, and a VM's speed moves more than a
simulator's error budget within the hour: on an AMD EPYC VM a one-thread 256-token prefill
took 1.66 s while the profile ran and 1.94-2.48 s an hour later, and every one-thread cell of
the accuracy table then read 11-26% low. A probe re-times a few of the grid's shapes on each
of the profile's thread counts (a minute, not half an hour) against the profile's own
predictions for them, and multiplies that thread count's coefficients by the ratio. The
serving stack's figures (CPU time of one Python process) scale by the one-thread ratio.

Only the speed moves: the shape the grid fitted (a token against a row against a context
token) and the wake curve are kept, and `machine["rescaled"]` records each ratio and when it
was taken. A probe is no substitute for profiling another machine: a profile of another CPU
or core count is refused.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace

from pdserve.perf.cost_model import StepCostModel, StepShape
from pdserve.perf.machine import check_same_machine
from pdserve.perf.measure import ProfileConfig, pinned_engine, time_grid, timing_env
from pdserve.perf.profile import HardwareProfile, ServedOverhead

Samples = list[tuple[StepShape, float]]
# Grid shapes (prompt tokens, requests) that give prefills of chat lengths, a batched prefill
# and batch-1 and batch-8 decodes: each a kind of step the workloads are made of.
PROBE_GRID = ((128, 1), (256, 1), (64, 8))
# Served figures that are seconds of CPU or latency (step_factor is a ratio: kept).
SERVED_SECONDS = ("request_s", "token_s", "send_step_s", "send_token_s", "remote_token_s",
                  "token_cpu_s")  # fmt: skip


def phase_ratios(model: StepCostModel, samples: Samples) -> tuple[float, float]:
    """Measured over predicted, the median of the prefill steps' and of the decode steps';
    ValueError if the samples lack either kind."""
    prefill = [t / model.predict(s) for s, t in samples if s.prefill_tokens]
    decode = [t / model.predict(s) for s, t in samples if not s.prefill_tokens]
    if not prefill or not decode:
        raise ValueError("a speed probe needs prefill and decode steps")
    return statistics.median(prefill), statistics.median(decode)


def speed_ratio(model: StepCostModel, samples: Samples) -> float:
    """The geometric mean of `phase_ratios`: the few long prefills and the many short decode
    steps weigh alike."""
    prefill, decode = phase_ratios(model, samples)
    return (prefill * decode) ** 0.5


def probe_ratios(
    profile: HardwareProfile, decode_steps: int | None = None, log=lambda line: None
) -> dict[int, float]:
    """`speed_ratio` per thread count of `profile`, timed here on the cores its workers get
    (one warm-up pass over PROBE_GRID, one timed; `decode_steps` as the profile's grid
    unless given)."""
    check_same_machine(profile)
    timing_env()
    cfg = ProfileConfig(model=profile.model.name, threads=tuple(sorted(profile.models)),
                        kv_cache_bytes=int(profile.kv_cache_bytes or 0) or None, repeats=1,
                        grid=PROBE_GRID)  # fmt: skip
    if decode_steps is not None:
        cfg = replace(cfg, decode_steps=decode_steps)
    ratios = {}
    for threads in cfg.threads:
        with pinned_engine(cfg, threads) as engine:
            samples = time_grid(cfg, engine)
        model = profile.cost_model(threads)
        ratios[threads] = speed_ratio(model, samples)
        prefill, decode = phase_ratios(model, samples)
        log(f"threads {threads}: prefill steps x{prefill:.3f}, decode steps x{decode:.3f} "
            f"their profiled time")  # fmt: skip
    return ratios


def rescaled(profile: HardwareProfile, ratios: dict[int, float]) -> HardwareProfile:
    """`profile` with each thread count's coefficients times its ratio and the served seconds
    times the smallest thread count's."""
    served_ratio = ratios[min(ratios)]
    served = asdict(profile.served)
    served.update({k: served[k] * served_ratio for k in SERVED_SECONDS})
    record = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "ratios": {str(k): round(v, 4) for k, v in ratios.items()}}  # fmt: skip
    return replace(
        profile,
        models={size: model.scaled(ratios[size]) for size, model in profile.models.items()},
        served=ServedOverhead(**served),
        machine={**profile.machine, "rescaled": record},
    )
