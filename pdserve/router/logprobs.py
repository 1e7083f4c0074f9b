"""Workers' token logprobs in OpenAI's two response shapes.

Chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}]}`. Completions: `choices[].logprobs = {tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}`. A token's text is the token decoded alone
(a piece of a multi-byte character decodes to U+FFFD, as in vLLM); `bytes` are that text's
UTF-8. The values are of the model's raw distribution (pdserve/model/logprobs.py). An echoed
prompt's first token has neither logprob nor alternatives: None (router/echo.py).
"""

from __future__ import annotations

from typing import Any

from pdserve.model.tokenizer import Tokenizer

# One sampled token as the driver hands it on: [token id, logprob, [[id, logprob], ...]].
Entry = list[Any]


class LogprobsFormatter:
    """Formats one response's entries, in order; completions' `text_offset` runs on across
    the stream's chunks."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.text_offset = 0

    def format(self, entries: list[Entry]) -> dict[str, Any]:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat(self, entries: list[Entry]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, logprob, top in entries:
            alternatives = [item(t, lp) for t, lp in top]
            content.append({**item(token_id, logprob), "top_logprobs": alternatives})
        return {"content": content}

    def _completion(self, entries: list[Entry]) -> dict[str, Any]:
        tokens, offsets = [], []
        for token_id, _, _ in entries:
            tokens.append(self._text(token_id))
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [
                None if top is None else {self._text(t): lp for t, lp in top}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }
