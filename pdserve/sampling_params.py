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
    # Logits processing (vLLM semantics; docs/sampling.md): repetition over prompt and output
    # tokens, presence and frequency over output tokens, a bias per token id, and EOS and
    # stop_token_ids masked until min_tokens are out.
    repetition_penalty: float = knob(1.0, "> 1 discourages any seen token", gt=0.0, le=100.0)
    presence_penalty: float = knob(0.0, "subtract once per generated token", ge=-2.0, le=2.0)
    frequency_penalty: float = knob(0.0, "subtract per occurrence", ge=-2.0, le=2.0)
    logit_bias: tuple[tuple[int, float], ...] = knob((), "(token id, bias) pairs", cli=False)
    min_tokens: int = knob(0, "no EOS or stop token before this many tokens", ge=0)
    # Log-probabilities of each sampled token and of this many likeliest alternatives
    # (None: none at all), from the model's raw distribution (docs/sampling.md).
    logprobs: int | None = knob(None, "top alternatives reported with each token", ge=0)
    # The same for each prompt token after the first (completions' `echo` with `logprobs`):
    # computed by the prefill, which then skips the prefix cache (docs/sampling.md).
    prompt_logprobs: int | None = knob(None, "alternatives per prompt token", ge=0, cli=False)
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
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens}")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        pairs = []
        for pair in self.logit_bias:
            token_id, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {pair!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"logit_bias values must be numbers, got {pair!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {pair!r}")
            pairs.append((token_id, float(bias)))
        if len({t for t, _ in pairs}) < len(pairs):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(pairs))

    @property
    def penalized(self) -> bool:
        """Whether the logits need processing before sampling (penalties, bias, min_tokens)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )
