"""`pdserve plan`: the deployments that serve a rate within SLOs on the fewest devices.

The budget never enters the simulation. Requests are independent and the router spreads
them evenly, so a deployment of K identical *units* serves K times one unit's goodput (the
assumption DistServe's placement search makes too). The search is therefore over units:

  1. sizes: each worker size the profile has whose weights leave room for KV (and, for
     tensor parallelism, fits in one node); the rest are pruned with the reason.
  2. units, estimated from the cost model alone (no simulation): a collocated worker of each
     size; for each (prefill size, decode size) the P:D count ratio that balances the two
     phases' capacities, as the nearest small ratio np:nd (np + nd <= 8).
        prefill capacity = requests/s one worker prefills in full-budget steps
        decode capacity  = requests/s one worker finishes at the largest batch whose step
                           meets the TPOT SLO and whose KV fits
  3. pruning: units whose estimated goodput per device is under half the best of their
     kind are dropped; the best `keep` of each kind go on.
  4. verification: each survivor is simulated (the real scheduler, block pool and router
     policy) with a goodput search: the highest rate whose SLO attainment meets the target.
  5. layout: replicas = budget // unit devices; the chosen layout is the one with the best
     simulated goodput per device among those whose replicas carry the rate.

So the work is a few cost-model evaluations per size pair plus ~`keep` x 2 x `max_probes`
short simulations, whatever the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import fmean

from pdserve.bench.app import BenchPlan
from pdserve.bench.metrics import SLO, fmt
from pdserve.bench.search import find_goodput
from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import StepShape
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.run import simulate_plan


@dataclass
class Candidate:
    unit: Deployment
    estimated_goodput: float  # requests/s of one unit, from the cost model
    goodput: float = 0.0  # requests/s of one unit, simulated
    why: str = ""
    max_gap_ms: float = math.nan  # the longest freeze at that rate (else the last probe's)

    @property
    def per_device(self) -> float:
        return self.goodput / self.unit.num_devices

    @property
    def estimated_per_device(self) -> float:
        return self.estimated_goodput / self.unit.num_devices


@dataclass
class PlanResult:
    candidates: list[Candidate]
    pruned: list[str]
    num_devices: int
    rate: float


def _mean_lengths(plan: BenchPlan) -> tuple[float, float]:
    turns = [t for s in plan.sessions for t in s.turns]
    return fmean(len(t.user_ids) for t in turns), fmean(t.output_len for t in turns)


def prefill_capacity(profile: HardwareProfile, size: int, cfg: SimConfig, input_len: float):
    """Requests/s one prefill worker sustains: prompts packed into full-budget steps."""
    budget = cfg.scheduler.max_num_batched_tokens
    per_step = max(1.0, budget / input_len)
    chunk = min(input_len, cfg.scheduler.long_prefill_token_threshold)
    pairs = per_step * input_len * (input_len / 2 + chunk / 2)
    shape = StepShape(prefill_tokens=int(per_step * input_len), prefill_attention_pairs=pairs)
    return per_step / profile.cost_model(size).predict(shape)


def decode_capacity(profile, size: int, cfg: SimConfig, input_len, output_len, tpot_s) -> float:
    """Requests/s one decode worker finishes at its largest batch that meets the TPOT SLO."""
    context = input_len + output_len / 2
    max_batch = min(cfg.scheduler.max_num_seqs, int(profile.kv_capacity_tokens(size) // context))
    model = profile.cost_model(size)
    best = 0.0
    for batch in range(1, max_batch + 1):
        step_s = model.predict(
            StepShape(decode_requests=batch, decode_context_tokens=int(batch * context))
        )
        if step_s <= tpot_s:
            best = batch / step_s / output_len
    return best


def _ratio(prefill_rate: float, decode_rate: float) -> tuple[int, int]:
    """Small np:nd (np + nd <= 8) closest to balancing np * prefill = nd * decode."""
    target = prefill_rate / decode_rate
    pairs = [(p, d) for p in range(1, 8) for d in range(1, 9 - p)]
    return min(pairs, key=lambda pd: (abs(math.log(pd[1] / pd[0] / target)), pd[0] + pd[1]))


def estimate_units(plan: BenchPlan, profile: HardwareProfile, cfg: SimConfig, slo: SLO):
    input_len, output_len = _mean_lengths(plan)
    tpot_s = slo.tpot_ms / 1000
    sizes, pruned = [], []
    for size in sorted(profile.models):
        if profile.size_unit == "tensor_parallel" and size > profile.devices_per_node:
            pruned.append(f"size {size}: tensor parallelism beyond one node")
            continue
        try:
            profile.kv_capacity_tokens(size)
        except ValueError as exc:
            pruned.append(f"size {size}: {exc}")
            continue
        sizes.append(size)
    candidates = []
    for size in sizes:
        p = prefill_capacity(profile, size, cfg, input_len)
        d = decode_capacity(profile, size, cfg, input_len, output_len, tpot_s)
        if d == 0:
            pruned.append(f"size {size}: even one decode step misses the TPOT SLO")
            continue
        both = 1 / (1 / p + 1 / d)  # one worker does both phases in turn
        unit = Deployment(num_collocated=1, collocated_size=size)
        candidates.append(Candidate(unit, both, why=f"prefill {p:.3g}/s, decode {d:.3g}/s"))
        for decode_size in sizes:
            d2 = decode_capacity(profile, decode_size, cfg, input_len, output_len, tpot_s)
            if d2 == 0:
                continue
            num_p, num_d = _ratio(p, d2)
            unit = Deployment(
                num_prefill=num_p, num_decode=num_d, prefill_size=size, decode_size=decode_size
            )
            why = f"prefill {p:.3g}/s per worker, decode {d2:.3g}/s per worker"
            candidates.append(Candidate(unit, min(num_p * p, num_d * d2), why=why))
    if not candidates:
        reasons = "; ".join(pruned) if pruned else "the profile has no worker sizes"
        raise ValueError(f"no deployment fits: {reasons}")
    return candidates, pruned


def search_layouts(
    plan: BenchPlan,
    profile: HardwareProfile,
    cfg: SimConfig,
    num_devices: int,
    rate: float,
    target: float = 0.9,
    keep: int = 3,
    max_probes: int = 6,
) -> PlanResult:
    slo = plan.slo
    if num_devices < 1:
        raise ValueError(f"--num-devices must be >= 1, got {num_devices}")
    candidates, pruned = estimate_units(plan, profile, cfg, slo)
    survivors = []
    for disaggregated in (False, True):
        group = [c for c in candidates if c.unit.is_disaggregated == disaggregated]
        group = [c for c in group if c.unit.num_devices <= num_devices]
        best = max((c.estimated_per_device for c in group), default=0.0)
        for c in group:
            if c.estimated_per_device < best / 2:
                pruned.append(
                    f"{c.unit.describe()}: estimated {c.estimated_per_device:.3g} "
                    f"req/s/device, under half the best"
                )
        group = [c for c in group if c.estimated_per_device >= best / 2]
        group.sort(key=lambda c: -c.estimated_per_device)
        survivors += group[:keep]
        pruned += [f"{c.unit.describe()}: not in the best {keep} estimates" for c in group[keep:]]
    if not survivors:
        smallest = min(c.unit.num_devices for c in candidates)
        raise ValueError(
            f"a budget of {num_devices} devices is too small for one replica "
            f"(the smallest fits in {smallest})"
        )
    for c in survivors:
        c.goodput, c.max_gap_ms = _simulated_goodput(plan, profile, cfg, c, target, max_probes)
    survivors.sort(key=lambda c: -c.per_device)
    return PlanResult(survivors, pruned, num_devices, rate)


def _simulated_goodput(
    plan, profile, cfg, candidate: Candidate, target, max_probes
) -> tuple[float, float]:
    """The highest probed rate meeting the target, and the longest freeze at it (at the last
    probe when none passed)."""
    summaries: dict[float, dict] = {}

    def probe(rate: float) -> float:
        run = replace(plan, run=replace(plan.run, arrival=plan.run.arrival.with_rate(rate)))
        result = simulate_plan(run, profile, candidate.unit, cfg)
        summaries[rate] = result.summary(plan.slo)
        return float(summaries[rate]["slo_attainment"])

    start = max(candidate.estimated_goodput * 0.5, 1e-3)
    search = find_goodput(probe, target, start, max_probes)
    shown = search.best_rate if search.best_rate > 0 else search.probes[-1][0]
    return search.best_rate, float(summaries[shown]["max_gap_ms"])


def format_plan(result: PlanResult, top: int, slo: SLO, wall_s: float) -> str:
    lines = [
        f"budget {result.num_devices} devices, rate {result.rate:g} req/s, "
        f"SLO TTFT {slo.ttft_ms:g} ms / TPOT {slo.tpot_ms:g} ms"
        + (f" / p99 ITL {slo.itl_ms:g} ms" if slo.itl_ms else "")
        + (f" / max gap {slo.max_gap_ms:g} ms" if slo.max_gap_ms else "")
        + f"; searched in {wall_s:.1f} s",
        f"{'unit':<38}{'devices':>8}{'goodput/s':>11}{'per device':>12}{'replicas':>10}"
        f"{'carries':>10}{'max gap ms':>12}  why",
    ]
    chosen = None
    for c in result.candidates[:top]:
        replicas = result.num_devices // c.unit.num_devices
        carries = replicas * c.goodput >= result.rate
        if carries and chosen is None:
            chosen = (c, math.ceil(result.rate / c.goodput) if c.goodput else 0)
        lines.append(
            f"{c.unit.describe():<38}{c.unit.num_devices:>8}{c.goodput:>11.3g}"
            f"{c.per_device:>12.3g}{replicas:>10}{'yes' if carries else 'no':>10}"
            f"{fmt(c.max_gap_ms, '.0f'):>12}  {c.why}"
        )
    if chosen is None:
        lines.append("no layout carries the rate within the budget")
    else:
        c, replicas = chosen
        lines.append(
            f"chosen: {replicas} x ({c.unit.describe()}) = {replicas * c.unit.num_devices} "
            f"devices, {c.per_device:.3g} req/s per device"
        )
    lines += [f"pruned: {reason}" for reason in result.pruned]
    return "\n".join(lines)
