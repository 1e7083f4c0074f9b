"""The adaptive planner's cost model, fitted online: one `StepCostModel` (pdserve/perf, the
simulator's class) per (role, threads), fed by the workers' StepReport rows; a
`TransferModel` fitted to the exposed KV transfer times the router measures; and the link
(`link`: bandwidth and latency), the profile's measured figures until the prefill workers'
own sends measure it (KV bytes over the seconds their sender spent writing them). Pure: no
I/O, no clock (callers pass times), so the simulator can drive it as the router does.

A remote prefill's exposed transfer is at least what the link cannot hide behind it: with
layer-wise sends the wire runs during the prefill, so `latency + max(0, wire - prefill)`.
The fit of exposed times answers when it says more (queueing on the link, a slow receiver).

Which model answers `step_s(role, threads, shape)`: the first that exists among those *usable
for the shape*: seeded from a profile, or fitted to at least `min_samples` steps that span
the shape (`_Fit.spans`: each feature it has was in some of them, and its prompt is within
PREFILL_RANGE of the longest they had; a decode worker that never prefilled knows nothing
of prefill cost, and one whose only prompt was 98 tokens knows little of a 2,000-token
one):
  1. (role, threads);
  2. both roles' steps at `threads` in one fit (a step's arithmetic is the same on either;
     only kernels differ): a decode worker's decode steps and a prefill worker's prompts
     together price a decode worker's prompt beside its decodes, which neither alone spans;
  3. the nearest thread count that has one, its time scaled by `t_have / threads` (a linear
     speed-up: an estimate, replaced as soon as that thread count has its own samples);
  4. None: the caller uses its documented fallback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.costmodel.profile import HardwareProfile
from pdserve.costmodel.step_cost import FEATURES, StepCostModel, StepShape, TransferModel

ROLES = ("prefill", "decode")
BOTH = "both"  # the fit of both roles' steps at a thread count (module docstring)
# A fit spans a shape whose prompt tokens are at most this many times the most a sample had
# (attention pairs: its square): past that the pairs column, which grows as the square,
# extrapolates. (Asking also for 4 samples of each feature left a default-model deployment
# without a price for its first 16 of 31 prompts at 90% load: all went remote, 0.36x
# collocated's goodput. Within the range, however a fit of one prompt split its time, each
# prompt column prices at most 4x what that prompt had.)
PREFILL_RANGE = 2.0
STEP_FIELDS = 7  # a StepReport row: 5 StepShape fields, threads, seconds
DECAY = 0.98  # per refit: a sample weighs half after ~35 refits (about 35 planner intervals)
MIN_TRANSFER_SAMPLES = 3
# Sends measured before the link's rate replaces the profile's: less KV than this is mostly
# socket buffers filling, not the link.
MIN_LINK_BYTES = 16 << 20
LINK_WINDOW = 64  # the link's rate is over the last this many measured intervals


@dataclass
class _Fit:
    model: StepCostModel
    num_new: int = 0  # samples since the last refit
    seeded: bool = False  # from a profile: usable before any sample
    seen: set[int] = field(default_factory=set)  # features some sample had (non-zero)
    most_prefill_tokens: int = 0  # the most prompt tokens, and attention pairs, of a sample
    most_pairs: float = 0.0

    def add(self, shape: StepShape, seconds: float) -> None:
        # Relative error, as `fit_cost_model`: a 20 ms decode step counts as much as a 2 s
        # prefill, or the fit would serve prefills and get ITL wrong.
        self.model.observe(shape, seconds, weight=1.0 / seconds**2)
        self.seen.update(i for i, x in enumerate(self.model.features(shape)) if x)
        self.most_prefill_tokens = max(self.most_prefill_tokens, shape.prefill_tokens)
        self.most_pairs = max(self.most_pairs, shape.prefill_attention_pairs)
        self.num_new += 1

    def spans(self, shape: StepShape) -> bool:
        """Whether this fit's samples span `shape` (the module docstring)."""
        features = self.model.features(shape)
        if any(x and i not in self.seen for i, x in enumerate(features)):
            return False
        return (
            shape.prefill_tokens <= PREFILL_RANGE * self.most_prefill_tokens
            and shape.prefill_attention_pairs <= PREFILL_RANGE**2 * self.most_pairs
        )


class OnlineCostModel:
    def __init__(self, min_samples: int, profile: HardwareProfile | None = None) -> None:
        self.min_samples = min_samples
        self.profile = profile
        self._fits: dict[tuple[str, int], _Fit] = {}
        self._transfer_samples: list[tuple[float, float]] = []  # (bytes, exposed seconds)
        self.transfer: TransferModel | None = None  # fitted to exposed times only
        self.link: TransferModel | None = None
        self._link_totals: dict[str, tuple[float, float]] = {}  # worker -> (bytes, seconds)
        self._link_samples: list[tuple[float, float]] = []  # (bytes, seconds) per interval
        if profile is not None:
            for threads, seeded in profile.models.items():
                for role in (*ROLES, BOTH):
                    self._fits[(role, threads)] = _Fit(_copy(seeded), seeded=True)
            if profile.transfer:
                self.link = profile.transfer_model()

    # ---- samples ------------------------------------------------------------------------

    def observe_steps(self, role: str, rows: Sequence[Sequence[float]]) -> int:
        """StepReport rows of a `role` worker; returns how many were usable (a row of the
        wrong width, an empty step or a non-positive time is skipped)."""
        role = _kind(role)
        used = 0
        for row in rows:
            if len(row) != STEP_FIELDS:
                continue
            prefill, decodes, pairs, context, sequences, threads, seconds = row
            shape = StepShape(
                int(prefill), int(decodes), float(pairs), int(context), int(sequences)
            )
            if shape.is_empty or not seconds > 0 or int(threads) < 1:
                continue
            for key in ((role, int(threads)), (BOTH, int(threads))):
                fit = self._fits.get(key)
                if fit is None:
                    fit = self._fits[key] = _Fit(_fresh(self.profile, int(threads)))
                fit.add(shape, float(seconds))
            used += 1
        return used

    def observe_transfer(self, num_bytes: float, seconds: float) -> None:
        """One request's exposed transfer: prefill_end -> kv_landed on the decode worker."""
        if num_bytes > 0 and seconds >= 0:
            self._transfer_samples = [*self._transfer_samples[-255:], (num_bytes, seconds)]

    def observe_link(self, worker_id: str, bytes_sent: float, send_s: float) -> None:
        """A prefill worker's cumulative KV bytes sent and seconds its sender spent writing
        them (its Stats): the increase since its last report is a sample of the link. Totals
        that went down are a restarted worker's, counted from there."""
        last_bytes, last_s = self._link_totals.get(worker_id, (0.0, 0.0))
        self._link_totals[worker_id] = (bytes_sent, send_s)
        num_bytes, seconds = bytes_sent - last_bytes, send_s - last_s
        if num_bytes < 0 or seconds < 0:
            num_bytes, seconds = bytes_sent, send_s
        if num_bytes > 0 and seconds > 0:
            self._link_samples = [*self._link_samples[1 - LINK_WINDOW :], (num_bytes, seconds)]

    def refit(self) -> None:
        """Refit the models that have new samples; older samples fade (`DECAY`)."""
        for fit in self._fits.values():
            if fit.num_new:
                fit.model.refit()
                fit.model.decay(DECAY)
                fit.num_new = 0
        if len(self._transfer_samples) >= MIN_TRANSFER_SAMPLES:
            self.transfer = _fit_transfer(self._transfer_samples) or self.transfer
        num_bytes = sum(b for b, _ in self._link_samples)
        if num_bytes >= MIN_LINK_BYTES:
            rate = num_bytes / sum(s for _, s in self._link_samples)
            self.link = TransferModel(rate, self.link.latency_s if self.link else 0.0)

    # ---- predictions --------------------------------------------------------------------

    def step_s(self, role: str, threads: int, shape: StepShape) -> float | None:
        """Seconds for a step of `shape` on a `role` worker with `threads` (module docstring
        for which model answers); None while no model is usable."""
        if shape.is_empty:
            return 0.0
        role, threads = _kind(role), max(1, threads)
        for key in ((role, threads), (BOTH, threads)):
            if self._usable(key, shape):
                return self._fits[key].model.predict(shape)
        usable = [k for k in self._fits if self._usable(k, shape)]
        if not usable:
            return None
        nearest = min(usable, key=lambda k: (abs(k[1] - threads), k[0] != role, k[1]))
        return self._fits[nearest].model.predict(shape) * nearest[1] / threads

    def wake_s(self, role: str, threads: int, idle_s: float) -> float:
        """What a step after `idle_s` idle costs more: the profile's measured curve for that
        thread count (steps fitted online run back to back and never show it); 0 without."""
        fit = self._fits.get((_kind(role), max(1, threads)))
        return fit.model.wake_s(idle_s) if fit is not None else 0.0

    def transfer_s(self, num_bytes: float, overlap_s: float = 0.0) -> float:
        """Exposed seconds of a transfer of `num_bytes` sent while a prefill of `overlap_s`
        runs (layer-wise): the larger of the fit of exposed times (from the third transfer
        on) and what the link leaves unhidden (module docstring); 0 with neither."""
        if num_bytes <= 0:
            return 0.0
        exposed_s = self.transfer.seconds(num_bytes) if self.transfer else 0.0
        if self.link is not None:
            wire_s = num_bytes / self.link.bandwidth_bytes_per_s
            exposed_s = max(exposed_s, self.link.latency_s + max(0.0, wire_s - overlap_s))
        return exposed_s

    def ready(self) -> bool:
        return any(self._usable(k) for k in self._fits)

    def _usable(self, key: tuple[str, int], shape: StepShape | None = None) -> bool:
        fit = self._fits.get(key)
        if fit is None or not (fit.seeded or fit.model.num_samples >= self.min_samples):
            return False
        if fit.seeded or shape is None:
            return True
        return fit.spans(shape)

    def state(self) -> dict[str, object]:
        """The fit state for /v1/status: per (role, threads) the samples and coefficients."""
        return {
            "models": [
                {
                    "role": role,
                    "threads": threads,
                    "num_samples": f.model.num_samples,
                    "seeded": f.seeded,
                    "usable": self._usable((role, threads)),
                    "coefficients": dict(zip(FEATURES, f.model.coefficients, strict=True)),
                }
                for (role, threads), f in sorted(self._fits.items())
            ],
            "transfer": None
            if self.transfer is None
            else {
                "bandwidth_bytes_per_s": self.transfer.bandwidth_bytes_per_s,
                "latency_s": self.transfer.latency_s,
                "num_samples": len(self._transfer_samples),
            },
            "link": {  # None: no profile, and the sends measured so far are too few
                "bandwidth_bytes_per_s": self.link and self.link.bandwidth_bytes_per_s,
                "latency_s": self.link and self.link.latency_s,
                "num_samples": len(self._link_samples),
            },
        }


def _kind(role: str) -> str:
    """Collocated steps mix prefill and decode like a decode worker prefilling locally."""
    return "prefill" if role == "prefill" else "decode"


def _copy(model: StepCostModel) -> StepCostModel:
    coefficients = list(model.coefficients)
    return StepCostModel(
        coefficients,
        model.knee_tokens,
        model.row_kernel_rows,
        prior=list(coefficients),
        wake=model.wake,
    )


def _fresh(profile: HardwareProfile | None, threads: int) -> StepCostModel:
    """A new model for `threads`: pulled towards the profile's fit for it when there is one."""
    if profile is not None and threads in profile.models:
        return _copy(profile.models[threads])
    return StepCostModel([0.0] * len(FEATURES))


def _fit_transfer(samples: Sequence[tuple[float, float]]) -> TransferModel | None:
    """latency + bytes / bandwidth by least squares (latency >= 0); None when the samples
    show no growth with bytes (all the same size, or the transfer fully hidden)."""
    x = np.asarray([b for b, _ in samples])
    y = np.asarray([s for _, s in samples])
    if np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        if slope > 0:
            return TransferModel(1.0 / slope, max(0.0, float(intercept)))
    mean_rate = float(np.sum(y) / np.sum(x))
    if mean_rate > 0 and math.isfinite(mean_rate):
        return TransferModel(1.0 / mean_rate)
    return None
