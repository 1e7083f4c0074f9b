"""Per-request sampling and stopping settings, validated once on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters. A
    `seed` makes sampling reproducible: the same seed gives the same output whatever else runs
    in the batch, because each token draws from a generator keyed by (seed, token index).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    kv_budget_tokens: int | None = None  # drop low-attention KV past this (None: deployment's)

    def __post_init__(self) -> None:
        # Accept lists and a lone string (as the OpenAI API does) but store tuples: frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.kv_budget_tokens is not None:
            _check_int("kv_budget_tokens", self.kv_budget_tokens, minimum=1)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
