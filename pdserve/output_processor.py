"""Token ids -> streamed text, with stop strings. Torch-free: the offline `LLM` and the
router both use it.

Stop strings are matched on text, so a match may end mid-token and may span tokens. While a
request runs, the last `max(len(stop)) - 1` characters are held back: they could still turn
out to start a stop string, and OpenAI-style APIs never return the stop string itself.

Work per token is bounded whatever the request's length: only the unsent tail is kept, and
it never exceeds the held-back characters plus one step's new text, so each token costs
O(num_stop * (hold_back + new text)), never a pass over everything generated so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextState:
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    hold_back: int  # characters that may still begin a stop string
    min_tokens: int = 0  # no stop string ends before the token after this many (vLLM's rule)
    pending: str = ""  # text not returned yet; at most hold_back chars between calls
    stopped: bool = False
    token_ids: list[int] = field(default_factory=list)


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: the caller must end the request


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def add_request(self, request_id: str, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        hold_back = max((len(s) for s in stop), default=1) - 1
        detokenizer = self.tokenizer.detokenizer()
        self.states[request_id] = TextState(detokenizer, tuple(stop), hold_back, min_tokens)

    def process(self, request_id: str, new_token_ids: list[int], finished: bool) -> TextDelta:
        """Feed new tokens; returns the text that may be sent now. After a stop-string match
        the request is over: later tokens are ignored."""
        state = self.states[request_id]
        if state.stopped:
            return TextDelta("", True)
        ready: list[str] = []
        for token in new_token_ids:
            state.token_ids.append(token)
            if self._add_text(state, state.detokenizer.push(token), ready):
                break
        if finished and not state.stopped:
            self._add_text(state, state.detokenizer.finish(), ready)
        if finished or state.stopped:
            ready.append(state.pending)
            state.pending = ""
        return TextDelta("".join(ready), state.stopped)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @staticmethod
    def _add_text(state: TextState, text: str, ready: list[str]) -> bool:
        """Append `text`, cut at a stop string, move what can no longer start one to `ready`.
        A match ending in `text` starts within the held-back tail, so only `pending` is
        searched, and only for matches that end in `text`: until the output holds more than
        `min_tokens` tokens none is looked for, and text from then cannot end one later."""
        if not text:
            return False
        old = len(state.pending)
        state.pending += text
        hits = []
        if len(state.token_ids) > state.min_tokens:
            starts = ((s, max(0, old - len(s) + 1)) for s in state.stop)
            hits = [i for s, start in starts if (i := state.pending.find(s, start)) >= 0]
        if hits:
            state.pending = state.pending[: min(hits)]
            state.stopped = True
            return True
        cut = len(state.pending) - state.hold_back
        if cut > 0:
            ready.append(state.pending[:cut])
            state.pending = state.pending[cut:]
        return False
