"""`pdserve profile --rescale PROFILE`: the profile at this machine's speed now.

A profile's grid takes half an hour on a slow CPU, and a VM's speed moves more than a
simulator's error budget within the hour: on an AMD EPYC VM a one-thread 256-token prefill
took 1.66 s while the profile ran and 1.94-2.48 s an hour later, and every one-thread cell of
the accuracy table then read 11-26% low. A probe re-times a few of the grid's shapes on each
of the profile's thread counts (a minute, not half an hour) against the same shapes as the
profile's grid timed them (`machine["probe"]`: measured over fitted, by phase), and
multiplies that thread count's coefficients by the ratio. A profile without a probe compares
with its model's predictions, which carries the fit's error at the probe's shapes into every
step.
The serving stack's figures (CPU time of one Python process) scale by the one-thread ratio.

Only the speed moves: the shape the grid fitted (a token against a row against a context
token), the wake curve and the served steps' factors are kept, and `machine["rescaled"]`
records each ratio and when it was taken. A probe is no substitute for profiling another
machine: a profile of another CPU or core count is refused.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, replace

from pdserve.costmodel.profile import HardwareProfile, ServedOverhead
from pdserve.costmodel.step_cost import StepCostModel, StepShape, phase_ratios
from pdserve.perf.machine import check_same_machine
from pdserve.perf.measure import PROBE_GRID, ProfileConfig, time_probe, timing_env

Samples = list[tuple[StepShape, float]]
# Served figures: seconds of CPU or latency, every one.
SERVED_SECONDS = ("request_s", "token_s", "remote_token_s", "token_cpu_s", "start_decode_s")


def relative_phases(
    model: StepCostModel, samples: Samples, baseline: Mapping[str, float] | None = None
) -> tuple[float, float]:
    """`phase_ratios`, each over the profile's own probe's (`baseline`) where it has one."""
    prefill, decode = phase_ratios(model, samples)
    if baseline:
        prefill, decode = prefill / baseline["prefill"], decode / baseline["decode"]
    return prefill, decode


def speed_ratio(
    model: StepCostModel, samples: Samples, baseline: Mapping[str, float] | None = None
) -> float:
    """The geometric mean of the prefill and the decode steps' `relative_phases`: the few
    long prefills and the many short decodes weigh alike."""
    prefill, decode = relative_phases(model, samples, baseline)
    return (prefill * decode) ** 0.5


def probe_grid(baseline: Mapping | None) -> tuple[tuple[int, int], ...]:
    """The entries a profile's probe `baseline` was taken on (its `shapes`); PROBE_GRID
    without a baseline."""
    if not baseline:
        return PROBE_GRID
    return tuple((int(p), int(n)) for p, n in baseline.get("shapes", PROBE_GRID))


def probe_ratios(
    profile: HardwareProfile, decode_steps: int | None = None, log=lambda line: None
) -> dict[int, float]:
    """`speed_ratio` per thread count of `profile`, `measure.time_probe` timed here on the
    cores its workers get, over the profile's baseline of the same shapes (as many decode
    steps as then unless `decode_steps`); a profile without one, over its model's
    predictions."""
    check_same_machine(profile)
    timing_env()
    baselines = profile.machine.get("probe", {})
    ratios = {}
    for threads in sorted(profile.models):
        baseline = baselines.get(str(threads))
        steps = decode_steps or (baseline or {}).get("decode_steps") or ProfileConfig.decode_steps
        cfg = ProfileConfig(
            model=profile.model.name,
            threads=(threads,),
            decode_steps=steps,
            kv_cache_bytes=int(profile.kv_cache_bytes or 0) or None,
        )
        samples = time_probe(cfg, threads, probe_grid(baseline))
        model = profile.cost_model(threads)
        prefill, decode = relative_phases(model, samples, baseline)
        ratios[threads] = (prefill * decode) ** 0.5
        than = "the profile's own probe" if baseline else "its model's predictions (no probe)"
        log(f"threads {threads}: prefill steps x{prefill:.3f}, decode steps x{decode:.3f} {than}")
    return ratios


def rescaled(profile: HardwareProfile, ratios: dict[int, float]) -> HardwareProfile:
    """`profile` with each thread count's coefficients and its `served_steps` seconds times its
    ratio (their factors, ratios of two speeds, kept), and the served seconds times the
    smallest thread count's."""
    served_ratio = ratios[min(ratios)]
    served = asdict(profile.served)
    served.update({k: served[k] * served_ratio for k in SERVED_SECONDS})
    record = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ratios": {str(k): round(v, 4) for k, v in ratios.items()},
    }
    return replace(
        profile,
        models={size: model.scaled(ratios[size]) for size, model in profile.models.items()},
        served=ServedOverhead(**served),
        served_steps={
            size: replace(
                steps,
                prefill_s=steps.prefill_s * ratios[size],
                decode_s=steps.decode_s * ratios[size],
            )
            for size, steps in profile.served_steps.items()
        },
        machine={**profile.machine, "rescaled": record},
    )
