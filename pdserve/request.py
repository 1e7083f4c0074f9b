"""A request as the engine sees it: token ids in, token ids out, plus KV bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import SamplingParams

# A warm-up computes the prompt and samples one token nobody sees; it ends plainly (a
# prefill worker runs it whole), so its blocks go back to the cache on every role.
WARMUP_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (or lost them to preemption)
    RUNNING = "running"  # scheduled each step until finished
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, KV arriving from a prefill
    SENDING_KV = "sending_kv"  # prefill role: computed; blocks pinned until the sends complete
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller
    HANDOFF = "handoff"  # prefill role: first token out, decoding continues on a decode worker


# `is_finished` runs a few times per request per step: an enum member's lookup through its
# class took 0.2 us (Python 3.11), half the property's time.
_FINISHED = RequestStatus.FINISHED


@dataclass
class Request:
    """One generation request.

    Token arithmetic (block_size 4, prompt of 6, 2 generated, 7 computed):

        tokens             p p p p | p p o o
        num_computed_tokens ------------- 7   (KV cached for the first 7 tokens)
        block_ids          [b0,      b1]      (ceil(num_tokens_with_kv / block_size) blocks)

    The last sampled token never has KV yet: it is the input of the next decode step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, grows with tokens
    # The cache scope its block hashes are salted with (kvcache/hashing.py): "" the default,
    # else a tenant's (the router derives it from the API key and `cache_salt`).
    cache_salt: str = ""
    prefill_only: bool = False  # prefill role: stop after the first token
    kv_budget_tokens: int | None = None  # token dropping: most KV tokens held at once
    # Tokens produced by an earlier attempt and now part of the prompt (a resumed request):
    # seeded sampling keys token i on i counted from the original start.
    num_prior_output_tokens: int = 0
    num_dropped_tokens: int = 0  # tokens whose KV was dropped (whole blocks)
    # Prefill role: the decode worker keeps only this many prompt blocks (dropped before the
    # transfer), so the prompt's blocks are scored even without a budget here.
    num_keep_blocks: int | None = None
    num_loaded_blocks: int = 0  # prefix blocks a lower tier put into L1 for it (metrics)
    # Cache warm-up (e.g. a deployment's system prompt, run with WARMUP_PARAMS): the prompt is
    # prefilled into the prefix cache; with True its full blocks are then pinned (never
    # evicted until unpinned). None: an ordinary request.
    pin: bool | None = None
    # At most this many prefill tokens in any step this request takes part in (the adaptive
    # planner's SLO-sized chunk, so the decodes sharing those steps keep their ITL target);
    # None: the scheduler's `long_prefill_token_threshold` alone.
    prefill_chunk_tokens: int | None = None
    # The adaptive planner's stall budget for the decodes beside this request's prefill: in
    # a step with decodes its prefill tokens are capped at what this worker measures to fit
    # (engine/stall_guard.py). None: no such cap.
    stall_budget_s: float | None = None
    # time.time() stamps for the router's TTFT breakdown (prefill_start, prefill_end,
    # kv_landed), sent with the request's next output and then cleared (router/timing.py).
    stamps: dict[str, float] = field(default_factory=dict)
    # Structured output (pdserve/engine/grammar.py): the request's matcher, and whether its
    # grammar can take no more tokens (the scheduler then ends it with "stop").
    grammar: Any = None
    grammar_done: bool = False
    # SamplingParams.prompt_logprobs set: one entry per prompt position (None for the first
    # token), filled chunk by chunk by the prefill and sent with the first token.
    prompt_logprobs: list[Any] | None = None

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV the request holds: computed minus dropped."""
        return self.num_computed_tokens - self.num_dropped_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Prompt and output tokens `[start:end]` without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED
