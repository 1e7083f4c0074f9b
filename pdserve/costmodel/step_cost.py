"""Step time as a function of what a step computes: one model for the simulator, the planner
and (online) the adaptive planner. Torch-free; numpy for the small least-squares solves.

A step runs `P` prefill tokens in `S` prefill rows (row `i`: `n_i` new tokens after `p_i`
already cached) and `D` one-token decodes (rows attending `c_j` context tokens). Its time is a
roofline:

    step_s = c_step                                     fixed cost (launch, sampling, weights
                                                        read once when memory-bound)
           + c_sequence * S                             per prefill row: its own attention
                                                        calls in every layer (not batched)
           + c_prefill * P + c_decode * D              per-token work below the knee
           + c_knee * max(0, P + D - knee_tokens)        compute-bound past the ridge point
           + c_pairs * sum_i n_i * (p_i + (n_i + 1)/2)   prefill attention (query-key pairs)
           + c_context * sum_j c_j                       decode attention (KV read)

A step's linear layers run its rows (prefill tokens and decodes together) in row (GEMV)
kernels up to `row_kernel_rows` rows and in GEMM tiles above (pdserve/model/quant_linear.py,
`gemv_m_max`; the model's and the build's on that host, so `pdserve profile` reads it from the
engine's linears and the profile keeps it with each model). Where it is finite, a row costs
what the kernels that run it cost, a prompt token or a decode alike:

    per-row work = c_decode * (P + D)                   P + D <= row_kernel_rows (row kernels)
                 = c_tiled_step + c_prefill * (P + D)   otherwise (tiles)

A row kernel reads the weights once and pays for every row (int8 dot products); the tiles
convert every weight block once a step (`c_tiled_step`) and then cost little per row. One
decode term could not price both: a 1B Q4_K_M decode batch of 16 took about what one of 32
did, four times one of 4 (docs/simulator.md). Infinite (an analytic roofline, weights
without row kernels): one regime, `c_prefill * P + c_decode * D`, `c_tiled_step` unused.

Each sampled row under a structured-output grammar costs `GRAMMAR_ROW_S` more (its token
mask, filled and applied before sampling, pdserve/engine/grammar.py): a measured constant,
not a coefficient, so profiles and fits are the same with or without constrained requests.

A step that starts after the worker sat idle costs `wake_s(idle)` more, a curve measured by
`pdserve profile` (points of idle seconds -> extra seconds, linear between them): on a VM two
OpenMP threads took 18 ms longer over a 100-token prefill after 0.1 s idle than back to back,
and one thread nothing (docs/simulator.md). Not a coefficient: a worker that steps without
pause never pays it, so the online fit neither sees nor needs it.

With `knee_tokens` fixed the model is linear in its coefficients, so fitting is least squares
(refreshed as samples arrive), and an analytic GPU roofline is the same model with computed
coefficients: memory-bound below the ridge (`c_step` holds the weight read), compute-bound
above it (`c_knee` is the FLOP time per token).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field

import numpy as np

from pdserve.schema import check, knob

# Seconds per constrained row and step: catch-up, mask fill, masking a 49,152-entry row and
# accept, 54-81 us a row at batch 32 (SmolLM2-135M, `benchmarks/openai_features.py grammar`, a
# 2-core Xeon VM under load).
GRAMMAR_ROW_S = 60e-6
FEATURES = (
    "step",
    "prefill_tokens",
    "decode_requests",
    "tokens_over_knee",
    "pairs",
    "context",
    "prefill_sequences",
    "tiled_step",
)


@dataclass(slots=True)
class StepShape:
    """What one step computes, in the units the model is linear in. Not frozen: the engine and
    the simulator build one per step, and a frozen dataclass's `__init__` costs 5x more."""

    prefill_tokens: int = 0
    decode_requests: int = 0
    prefill_attention_pairs: float = 0.0  # sum over prefill rows of n * (p + (n + 1) / 2)
    decode_context_tokens: int = 0  # sum over decode rows of the tokens they attend
    # Prefill rows; None: one when there are prefill tokens (a single chunk, as the planner's
    # what-ifs describe). On CPU each row's attention runs alone in every layer: a 32-token
    # prefill on two threads took 40 ms against a decode step's 8 (docs/simulator.md).
    prefill_sequences: int | None = None
    grammar_rows: int = 0  # sampled rows under a structured-output grammar

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_requests == 0

    @property
    def num_prefill_sequences(self) -> int:
        if self.prefill_sequences is not None:
            return self.prefill_sequences
        return 1 if self.prefill_tokens else 0

    @classmethod
    def of(cls, scheduled: Iterable[tuple[object, int]]) -> StepShape:
        """The shape of a scheduler step: `(request, num_new_tokens)` pairs, each request with
        `num_computed_tokens` (its KV before this step) and `num_dropped_tokens`."""
        prefill = decode = context = sequences = grammar = 0
        pairs = 0.0
        for request, num_new in scheduled:
            samples = request.num_computed_tokens + num_new >= len(request.prompt_token_ids)
            grammar += samples and getattr(request, "grammar", None) is not None
            prior = request.num_computed_tokens - request.num_dropped_tokens
            if num_new == 1 and request.num_computed_tokens >= len(request.prompt_token_ids):
                decode += 1
                context += prior + 1
            else:
                prefill += num_new
                sequences += 1
                pairs += num_new * (prior + (num_new + 1) / 2)
        return cls(prefill, decode, pairs, context, sequences, grammar)


@dataclass
class StepCostModel:
    """Coefficients (seconds per unit of each of `FEATURES`) for one worker configuration
    (a thread count on CPU, a tensor-parallel degree on GPU). Invariant: all >= 0."""

    coefficients: list[float]
    knee_tokens: float = math.inf
    # The most rows (P + D) a step's linear layers run in row kernels; above it, in tiles.
    row_kernel_rows: float = math.inf
    # Online refits pull towards these (the profile's fit) with this many samples' weight.
    prior: list[float] | None = None
    prior_weight: float = 20.0
    # (idle seconds, extra seconds) in increasing idle order; empty: no cost.
    wake: list[tuple[float, float]] = field(default_factory=list)
    _xtx: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    _xty: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    num_samples: int = 0

    def __post_init__(self) -> None:
        if len(self.coefficients) == len(FEATURES) - 1 and math.isinf(self.row_kernel_rows):
            # One regime has no tiled step to price.
            self.coefficients = [*self.coefficients, 0.0]
            if self.prior is not None and len(self.prior) == len(FEATURES) - 1:
                self.prior = [*self.prior, 0.0]
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(
                f"coefficients: expected {len(FEATURES)} ({', '.join(FEATURES)}), "
                f"got {len(self.coefficients)}"
            )
        if any(not c >= 0 for c in self.coefficients):
            raise ValueError(f"coefficients must be >= 0, got {self.coefficients}")
        if not self.knee_tokens > 0:
            raise ValueError(f"knee_tokens must be > 0, got {self.knee_tokens}")
        if not self.row_kernel_rows >= 0:
            raise ValueError(f"row_kernel_rows must be >= 0, got {self.row_kernel_rows}")
        self.wake = [(float(i), float(x)) for i, x in self.wake]
        idle = [i for i, _ in self.wake]
        if idle != sorted(set(idle)) or any(not (i >= 0 and x >= 0) for i, x in self.wake):
            raise ValueError(
                f"wake: expected (idle_s, extra_s) pairs >= 0 by rising idle_s, got {self.wake}"
            )
        self.coefficients = [float(c) for c in self.coefficients]
        n = len(FEATURES)
        self._xtx = np.zeros((n, n))
        self._xty = np.zeros(n)

    def features(self, shape: StepShape) -> list[float]:
        tokens = shape.prefill_tokens + shape.decode_requests
        over = max(0.0, tokens - self.knee_tokens) if math.isfinite(self.knee_tokens) else 0.0
        prefill, decode, tiled = self._rows(shape.prefill_tokens, shape.decode_requests)
        return [
            1.0,
            float(prefill),
            float(decode),
            over,
            float(shape.prefill_attention_pairs),
            float(shape.decode_context_tokens),
            float(shape.num_prefill_sequences),
            tiled,
        ]

    def _rows(self, prefill: int, decode: int) -> tuple[int, int, float]:
        """The rows `c_prefill` and `c_decode` price and the tiled steps `c_tiled_step` does:
        (P, D, 0) in one regime; with two, every row by its kernels (module docstring)."""
        rows = prefill + decode
        if math.isinf(self.row_kernel_rows):
            return prefill, decode, 0.0
        return (rows, 0, 1.0) if rows > self.row_kernel_rows else (0, rows, 0.0)

    def predict(self, shape: StepShape) -> float:
        """Seconds for a step of this shape (0 for an empty step)."""
        prefill, decode = shape.prefill_tokens, shape.decode_requests
        if not prefill and not decode:
            return 0.0
        # `features(shape)` dotted with the coefficients, spelled out: the simulator asks
        # this once per simulated step.
        c = self.coefficients
        over = prefill + decode - self.knee_tokens
        rows_p, rows_d, tiled = self._rows(prefill, decode)
        return (
            c[0]
            + c[1] * rows_p
            + c[2] * rows_d
            + (c[3] * over if over > 0 else 0.0)
            + c[4] * shape.prefill_attention_pairs
            + c[5] * shape.decode_context_tokens
            + c[6] * shape.num_prefill_sequences
            + c[7] * tiled
            + GRAMMAR_ROW_S * shape.grammar_rows
        )

    def scaled(self, factor: float) -> StepCostModel:
        """The same model `factor` times slower (its wake curve, an idle cost, kept)."""
        return StepCostModel(
            [c * factor for c in self.coefficients],
            self.knee_tokens,
            self.row_kernel_rows,
            wake=self.wake,
        )

    def wake_s(self, idle_s: float) -> float:
        """What a step costs more after `idle_s` seconds with nothing to run."""
        if not self.wake or idle_s <= 0:
            return 0.0
        return float(np.interp(idle_s, *zip(*[(0.0, 0.0), *self.wake], strict=True)))

    def observe(self, shape: StepShape, step_s: float, weight: float = 1.0) -> None:
        """Add one measured step; `refit()` turns the samples into coefficients."""
        x = np.asarray(self.features(shape))
        step_s -= GRAMMAR_ROW_S * shape.grammar_rows  # priced apart, never fitted
        self._xtx += weight * np.outer(x, x)
        self._xty += weight * step_s * x
        self.num_samples += 1

    def decay(self, factor: float) -> None:
        """Shrink the weight of past samples (an online fit that follows a drifting machine)."""
        self._xtx *= factor
        self._xty *= factor

    def refit(self) -> None:
        """Least squares over the samples so far, ridge-pulled towards `prior` (feature by
        feature, scaled by that feature's size in the samples), with coefficients held >= 0:
        a negative one is pinned to 0 and the rest solved again (an active set)."""
        if self.num_samples == 0:
            return
        n = len(FEATURES)
        scale = np.sqrt(np.maximum(np.diag(self._xtx), 1e-30) / max(self.num_samples, 1))
        prior = np.asarray(self.prior if self.prior is not None else np.zeros(n))
        ridge = (self.prior_weight if self.prior is not None else 1e-6) * scale**2
        free = [i for i in range(n) if self._xtx[i, i] > 0 or prior[i] > 0]
        solution = np.zeros(n)
        while free:
            idx = np.asarray(free)
            a = self._xtx[np.ix_(idx, idx)] + np.diag(ridge[idx])
            b = self._xty[idx] + ridge[idx] * prior[idx]
            sol = np.linalg.lstsq(a, b, rcond=None)[0]
            negative = [int(i) for i, v in zip(idx, sol, strict=True) if v < 0]
            if not negative:
                solution[idx] = sol
                break
            free = [i for i in free if i not in negative]
        self.coefficients = [float(v) for v in solution]

    def fit(self, samples: Sequence[tuple[StepShape, float]]) -> None:
        """Observe every `(shape, step_s)` and refit."""
        for shape, step_s in samples:
            self.observe(shape, step_s)
        self.refit()

    def to_dict(self) -> dict[str, object]:
        knee = self.knee_tokens if math.isfinite(self.knee_tokens) else None
        rows = self.row_kernel_rows if math.isfinite(self.row_kernel_rows) else None
        return {
            "coefficients": dict(zip(FEATURES, self.coefficients, strict=True)),
            "knee_tokens": knee,
            "row_kernel_rows": rows,
            "wake": [list(p) for p in self.wake],
        }

    @classmethod
    def from_dict(cls, data: dict) -> StepCostModel:
        coefficients = dict(data["coefficients"])
        rows = data.get("row_kernel_rows")
        if rows is None:
            # One regime (as profiles were fitted before the split): no tiled step to price.
            coefficients.setdefault("tiled_step", 0.0)
        missing = [f for f in FEATURES if coefficients.get(f) is None]
        if missing:
            raise ValueError(f"cost model lacks coefficients {missing}")
        values = [float(coefficients[f]) for f in FEATURES]
        knee = data.get("knee_tokens")
        return cls(
            values,
            math.inf if knee is None else float(knee),
            math.inf if rows is None else float(rows),
            prior=list(values),
            wake=[tuple(p) for p in data.get("wake", [])],
        )


@dataclass(frozen=True)
class ServedSteps:
    """A served worker's steps against its cost model, by phase: a step with prefill tokens
    takes `prefill_s + prefill_factor * model`, a decode step `decode_s + decode_factor *
    model`. `pdserve profile` fits the lines to the steps workers ran under a load of
    requests (perf/served_steps.py): the router, the client and the other workers take
    cores and memory bandwidth from them, which an engine timed alone does not see."""

    prefill_s: float = knob(0.0, ge=0)
    prefill_factor: float = knob(1.0, gt=0)
    decode_s: float = knob(0.0, ge=0)
    decode_factor: float = knob(1.0, gt=0)

    def __post_init__(self) -> None:
        check(self, "served_steps.")


class ServedCostModel:
    """`model`'s steps as a served worker runs them (`ServedSteps`); its wake curve kept.
    What the simulator prices a worker's steps with where the profile measured the lines."""

    __slots__ = ("model", "steps")

    def __init__(self, model: StepCostModel, steps: ServedSteps) -> None:
        self.model, self.steps = model, steps

    def predict(self, shape: StepShape) -> float:
        seconds = self.model.predict(shape)
        if not seconds:
            return 0.0
        s = self.steps
        if shape.prefill_tokens:
            return s.prefill_s + s.prefill_factor * seconds
        return s.decode_s + s.decode_factor * seconds

    def wake_s(self, idle_s: float) -> float:
        return self.model.wake_s(idle_s)


@dataclass(frozen=True)
class TransferModel:
    """Time to move `num_bytes` of KV between two workers: latency + bytes / bandwidth."""

    bandwidth_bytes_per_s: float = knob(MISSING, gt=0)
    latency_s: float = knob(0.0, ge=0)

    def __post_init__(self) -> None:
        check(self)

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


def fit_cost_model(
    samples: Sequence[tuple[StepShape, float]],
    knee_candidates: Iterable[float] = (),
    row_kernel_rows: float = math.inf,
) -> StepCostModel:
    """The best model over the knee candidates (and no knee), judged by relative error: each
    sample weighs 1/step_s^2, so a 20 ms decode step counts as much as a 2 s prefill.
    `row_kernel_rows`: the engine's (StepCostModel); the model keeps it only where the samples
    have steps in row kernels and decode steps in tiles (without those, `c_tiled_step` and
    `c_sequence` are one column, or a regime's rows go unpriced): else one regime."""
    if not samples:
        raise ValueError("cannot fit a cost model to no samples")
    if not _both_regimes(samples, row_kernel_rows):
        row_kernel_rows = math.inf
    best: tuple[float, StepCostModel] | None = None
    for knee in [math.inf, *knee_candidates]:
        model = StepCostModel([0.0] * len(FEATURES), knee, row_kernel_rows)
        for shape, step_s in samples:
            model.observe(shape, step_s, weight=1.0 / max(step_s, 1e-9) ** 2)
        model.refit()
        error = sum((model.predict(s) / t - 1) ** 2 for s, t in samples)
        if best is None or error < best[0]:
            best = (error, model)
    assert best is not None
    fitted = best[1]
    fitted.prior = list(fitted.coefficients)
    return fitted


def _both_regimes(samples: Sequence[tuple[StepShape, float]], row_kernel_rows: float) -> bool:
    """Whether some samples run in row kernels and some decode-only ones in tiles."""
    rows = [s.prefill_tokens + s.decode_requests for s, _ in samples]
    return any(n <= row_kernel_rows for n in rows) and any(
        n > row_kernel_rows and not s.prefill_tokens
        for n, (s, _) in zip(rows, samples, strict=True)
    )


def phase_ratios(
    model: StepCostModel, samples: Sequence[tuple[StepShape, float]]
) -> tuple[float, float]:
    """Measured over predicted: the median of the prefill steps' ratios and of the decode
    steps'; ValueError if the samples lack either kind."""
    prefill = [t / model.predict(s) for s, t in samples if s.prefill_tokens]
    decode = [t / model.predict(s) for s, t in samples if not s.prefill_tokens]
    if not prefill or not decode:
        raise ValueError("a speed probe needs prefill and decode steps")
    return statistics.median(prefill), statistics.median(decode)
