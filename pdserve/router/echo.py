"""Completions' `echo`: the response's text starts with the prompt's, and with `logprobs` the
prompt's tokens are scored too (OpenAI's legacy completions and vLLM): the first prompt token
with a null logprob and null alternatives, each later one with its logprob under the model
given the tokens before it. The prefill computes them (SamplingParams.prompt_logprobs, the
same number of alternatives as `logprobs`) and sends them with the first token; streamed,
the first chunk carries the prompt.

`max_tokens: 0` (score a prompt without generating, as evaluation harnesses do) runs as
vLLM runs it: the workers generate one token, which is dropped here; the answer is the
prompt alone, finish_reason "length", and usage counts that token (it was computed).

The scores travel in one message, the first token's, which the router's control socket
takes only up to `max_message_bytes`: a request whose scores could not fit is a 400 naming
`logprobs` (`check_size`), never a frame the socket drops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdserve.messages import FIELDS_BYTES
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.delta import Delta
from pdserve.router.protocol import ApiError, ApiRequest, bad_gateway

# msgpack bytes of one prompt token's scores, at most: [logprob, [alternatives]] is 9 bytes
# of float64 and up to 4 of headers, each [id, logprob] alternative 1 + 5 (a uint32) + 9.
ENTRY_BYTES, ALTERNATIVE_BYTES = 13, 15


def check_size(num_prompt_tokens: int, num_top: int | None, max_message_bytes: int) -> None:
    """400 naming `logprobs` when `num_prompt_tokens` tokens' scores with `num_top`
    alternatives each (None: not asked) could overflow one worker message."""
    if num_top is None:
        return
    need = num_prompt_tokens * (ENTRY_BYTES + ALTERNATIVE_BYTES * num_top) + FIELDS_BYTES
    if need > max_message_bytes:
        message = (
            f"echo with logprobs={num_top} over {num_prompt_tokens} prompt tokens needs a "
            f"{need}-byte worker message, over max_message_bytes ({max_message_bytes}); ask "
            "for fewer alternatives or send a shorter prompt"
        )
        raise ApiError(400, message, param="logprobs")


class Echo:
    """One request's echo, shared by its choices (`n`, `best_of`): only the first sample
    scores the prompt (router/choices.py); its first token, which comes before any other
    sample starts, brings the scores every choice then starts with."""

    def __init__(
        self, api: ApiRequest, prompt_ids: list[int], tokenizer: Tokenizer, scored: bool
    ) -> None:
        text = api.prompt if isinstance(api.prompt, str) else None
        if text is None:
            text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.text, self.prompt_ids, self.scored = text, prompt_ids, scored
        self.generate = api.max_tokens != 0
        self.entries: list[list[Any]] | None = None  # the prompt's, once they arrived

    async def wrap(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """`deltas` with the prompt before the first: its text and (`scored`) its tokens'
        logprobs entries ahead of the first token's."""
        first = True
        async for delta in deltas:
            if not first:
                if self.generate:
                    yield delta
                continue
            first = False
            if self.scored and self.entries is None:
                self.entries = prompt_entries(self.prompt_ids, delta.prompt_logprobs)
            entries = None if self.entries is None else list(self.entries)
            if not self.generate:
                yield Delta(self.text, "length", entries)
                continue
            if entries is not None:
                entries += delta.logprobs or []
            yield Delta(self.text + delta.text, delta.finish_reason, entries)


def prompt_entries(prompt_ids: list[int], found: list[Any] | None) -> list[list[Any]]:
    """[[token id, logprob, [[id, logprob], ...]]] per prompt token, the first one's logprob
    and alternatives None (router/logprobs.py formats them)."""
    if found is None or len(found) != len(prompt_ids):
        got = "none" if found is None else f"{len(found)} for {len(prompt_ids)} tokens"
        raise bad_gateway(f"the worker sent no prompt logprobs with the first token ({got})")
    return [[prompt_ids[0], None, None]] + [[t, *e] for t, e in zip(prompt_ids[1:], found[1:])]
