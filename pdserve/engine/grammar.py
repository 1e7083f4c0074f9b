"""Structured outputs in the engine: each constrained request's grammar state, its token mask,
applied to the logits just before sampling.

A request with `SamplingParams.grammar` (built by `pdserve/grammar.py`) gets an llguidance
matcher when the engine admits it, compiled once per grammar and copied per request. Each
step, the matcher first catches up with every token the request already holds
(`_replayed_tokens`), then fills the row's bitmask. Catching up covers
every way tokens arrive without being sampled here: a decode worker receives the prefill
worker's first token in `StartDecode`, a resumed request carries its earlier output in its
prompt. So a disaggregated request's grammar state is the collocated one's, token for token.

After sampling, each matcher takes its token; a grammar that can take no more ends the
request with finish_reason "stop" (`Request.grammar_done`, read by the scheduler).

The masks are filled on the engine's own thread, not overlapped with the forward pass: a
worker thread filling them during the forward pass made decode steps slower, not faster
(batch 1, SmolLM2-135M on a busy 2-core VM: +121% TPOT against +17% in line). The forward
pass holds the GIL between torch ops, so the thread's GIL hand-offs stall the step by a
scheduler slice each, while the fill itself takes 0.1-0.2 ms for 32 rows.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import torch

from pdserve.request import Request

log = logging.getLogger(__name__)

_MAX_COMPILED = 64  # grammars kept compiled; requests repeat schemas


@dataclass
class GrammarState:
    """One request's matcher and how many of its tokens it has taken."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class GrammarMasks:
    """Masks for one step's constrained rows: `apply()` waits for the fill and masks the
    logits; `accept()` advances each matcher by its sampled token."""

    def __init__(self, rows: list[tuple[int, Request]], mask: np.ndarray) -> None:
        self.rows = rows  # (logits row, request)
        self._mask = mask

    def apply(self, logits: torch.Tensor) -> None:
        """Banned tokens' logits to -inf. The mask is numpy and so is the CPU path, on one
        thread: torch spreads such small element-wise ops (and even a [32, 1536] zeros) over
        its intra-op threads, whose barriers cost more than the work on a busy machine
        (16 ms for the zeros, 60-140 ms for the masking at batch 32, against 1-2 ms)."""
        vocab = logits.shape[-1]
        rows = [row for row, _ in self.rows]
        banned = np.unpackbits(self._mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
        if logits.device.type == "cpu":
            values = logits.numpy()
            for j, row in enumerate(rows):
                np.copyto(values[row], -np.inf, where=banned[j])
            return
        index = torch.tensor(rows, device=logits.device)
        banned_t = torch.from_numpy(banned).to(logits.device)
        logits[index] = logits[index].masked_fill(banned_t, float("-inf"))

    def accept(self, tokens: list[int]) -> None:
        for row, request in self.rows:
            state = request.grammar
            ok = state.matcher.consume_token(tokens[row])
            state.num_consumed += 1
            if not ok or state.matcher.is_stopped():
                request.grammar_done = True
                if not ok:  # sampled under this matcher's own mask: cannot happen
                    log.warning(
                        "request %s: grammar refused its token: %s",
                        request.request_id,
                        state.matcher.get_error(),
                    )


class Grammars:
    """The model runner's grammar side: the llguidance tokenizer (built at the first
    constrained request: ~0.6 s for a 49k vocabulary) and the compiled grammars."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size  # the logits' width: the mask covers every row entry
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def begin(self, requests: list[Request]) -> GrammarMasks | None:
        """The masks of the constrained rows among `requests` (one per sampled row, in row
        order); None when no row is constrained (the common case costs a scan)."""
        rows = [(i, r) for i, r in enumerate(requests) if r.sampling_params.grammar is not None]
        if not rows:
            return None
        for _, request in rows:
            self._catch_up(request)
        words = (self._vocab_size + 31) // 32
        mask = np.empty((len(rows), words), dtype=np.int32)  # every row is filled whole
        row_bytes = words * 4
        for j, (_, request) in enumerate(rows):
            request.grammar.matcher.unsafe_compute_mask_ptr(mask[j].ctypes.data, row_bytes)
        return GrammarMasks(rows, mask)

    def state(self, grammar: str) -> GrammarState:
        """A fresh matcher for a new request (ValueError: the grammar does not compile
        against this model's tokenizer; the request is refused, never half run)."""
        return GrammarState(self._matcher(grammar))

    def _catch_up(self, request: Request) -> None:
        state = request.grammar
        tokens = _replayed_tokens(request)
        for token in tokens[state.num_consumed :]:
            if not state.matcher.consume_token(token):
                log.warning(
                    "request %s: grammar refused a replayed token: %s",
                    request.request_id,
                    state.matcher.get_error(),
                )
        state.num_consumed = len(tokens)

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf  # imports transformers: 1.5-4 s of a worker's start if eager

            from pdserve.model.tokenizer import Tokenizer

            tokenizer = Tokenizer(self._model_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer.backend, n_vocab=self._vocab_size, eos_token=tokenizer.eos_token_ids
            )
        return self._tokenizer


def _replayed_tokens(request: Request) -> list[int]:
    """The request's output so far, counted from its first attempt: a resumed request's
    earlier output is the tail of its prompt."""
    prior = request.num_prior_output_tokens
    earlier = request.prompt_token_ids[len(request.prompt_token_ids) - prior :] if prior else []
    return earlier + request.output_token_ids
