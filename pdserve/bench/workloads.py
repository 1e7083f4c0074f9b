"""Workloads: sessions of turns with exact token lengths, generated from a seed.

A *session* is the unit the runner schedules: a single request is a one-turn session; a
multi-turn conversation is a session whose turn k is sent only after turn k-1 answered, with
prompt = previous prompts + the model's actual answers + this turn's new user tokens (the
runner builds that history, because the answers exist only at run time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.bench.tokens import TokenSource, join_text

# Token-length shapes of common workloads (lognormal: mean tokens, sigma of the log).
PRESETS: dict[str, tuple[str, str]] = {
    "chat": ("lognormal:256:0.8", "lognormal:256:0.6"),
    "summarization": ("lognormal:2048:0.5", "lognormal:128:0.5"),
    "code": ("lognormal:1024:0.6", "lognormal:64:0.6"),
}


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``N``, ``uniform:LO:HI`` or ``lognormal:MEAN:SIGMA[:MAX]``.

    Lognormal is parameterised by its *mean* (what users know about their traffic) and the
    sigma of the underlying normal; mu = ln(mean) - sigma^2/2 makes the mean come out right.
    Samples are clipped to [1, max] (max defaults to 8x the mean) so one tail sample cannot
    blow a small machine's context.
    """

    kind: str
    a: float
    b: float = 0.0
    max_len: int = 0

    @classmethod
    def parse(cls, spec: str, name: str = "length") -> LengthDist:
        parts = str(spec).split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", int(parts[0]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "lognormal" and len(parts) in (3, 4):
                cap = int(parts[3]) if len(parts) == 4 else int(8 * float(parts[1]))
                dist = cls("lognormal", float(parts[1]), float(parts[2]), cap)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{name} {spec!r}: expected N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MAX]"
            ) from None
        if dist.a < 1 or dist.b < 0 or (dist.kind == "uniform" and dist.b < dist.a):
            raise ValueError(f"{name} {spec!r}: lengths must be >= 1 and LO <= HI")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n).tolist()
        mu = math.log(self.a) - self.b**2 / 2
        values = np.rint(rng.lognormal(mu, self.b, size=n))
        return np.clip(values, 1, max(self.max_len, 1)).astype(int).tolist()


@dataclass
class Turn:
    """One request's new content: user tokens (and their text form) and the output length."""

    user_ids: list[int]
    output_len: int
    user_text: str | None = None


@dataclass
class Session:
    """Turns sent one after another; ``arrival_s`` is set only by trace replay."""

    session_id: str
    turns: list[Turn]
    arrival_s: float | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate. ``input_len`` is the unique part; a shared prefix comes on top."""

    num_requests: int = 100
    input_len: str = "256"
    output_len: str = "128"
    num_prefix_groups: int = 0
    prefix_len: int = 0
    num_turns: int = 1
    text_prompts: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefix_groups > 0 and self.prefix_len < 1:
            raise ValueError("--num-prefix-groups needs --prefix-len >= 1")
        LengthDist.parse(self.input_len, "--input-len")
        LengthDist.parse(self.output_len, "--output-len")


def build_sessions(cfg: WorkloadConfig, tokens: TokenSource) -> list[Session]:
    """Sessions holding exactly ``cfg.num_requests`` turns, deterministic in ``cfg.seed``.

    Shared-prefix groups: session i gets group ``i % num_prefix_groups``'s system prompt in
    front of its first turn. With text prompts the prefix text is fitted once per group, so
    every member sends the identical string.
    """
    rng = np.random.default_rng(cfg.seed)
    input_lens = LengthDist.parse(cfg.input_len, "--input-len").sample(rng, cfg.num_requests)
    output_lens = LengthDist.parse(cfg.output_len, "--output-len").sample(rng, cfg.num_requests)
    prefixes = [
        tokens.random_prompt(rng, cfg.prefix_len, cfg.text_prompts)
        for _ in range(cfg.num_prefix_groups)
    ]
    sessions: list[Session] = []
    for index in range(cfg.num_requests):
        if index % cfg.num_turns == 0:
            sessions.append(Session(f"s{len(sessions)}", []))
        session = sessions[-1]
        ids, text = tokens.random_prompt(rng, input_lens[index], cfg.text_prompts)
        if not session.turns and prefixes:
            prefix_ids, prefix_text = prefixes[(len(sessions) - 1) % len(prefixes)]
            ids, text = prefix_ids + ids, join_text(prefix_text, text)
        session.turns.append(Turn(ids, output_lens[index], text if cfg.text_prompts else None))
    return sessions
