"""Per-request sampling and stopping settings, validated once on construction."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.schema import check, knob


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters. A
    `seed` makes sampling reproducible: the same seed gives the same output whatever else runs
    in the batch, because each token draws from a generator keyed by (seed, token index).
    """

    max_tokens: int = knob(16, "most tokens to generate", ge=1)
    temperature: float = knob(1.0, "0 = greedy", ge=0.0, le=100.0)
    top_k: int = knob(0, "sample from the k likeliest tokens (<= 0: all)", ge=-1)
    top_p: float = knob(1.0, "sample from the smallest set holding this mass", gt=0.0, le=1.0)
    seed: int | None = knob(None, "per-request seed", ge=-(2**63), flag="sampling_seed")
    stop: tuple[str, ...] = knob((), "stop string")
    stop_token_ids: tuple[int, ...] = knob((), "stop token id")
    ignore_eos: bool = knob(False, "generate past the end-of-sequence token")
    # Drop low-attention KV past this (None: the deployment's); the engine flag sets that.
    kv_budget_tokens: int | None = knob(None, ge=1, cli=False)
    # Structured output: llguidance's serialized grammar (`grammar_of()` in pdserve/grammar.py).
    grammar: str | None = knob(None, "constrain the output to this grammar", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        check(self)
        if not all(self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
