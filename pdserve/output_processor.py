"""Token ids -> streamed text, with stop strings. Torch-free: the offline `LLM` and the
router both use it.

Stop strings are matched on text, so a match may end mid-token and may span tokens. While a
request runs, the last `max(len(stop)) - 1` characters are held back: they could still turn
out to start a stop string, and OpenAI-style APIs never return the stop string itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextState:
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    text: str = ""  # all text so far (stop string excluded once matched)
    num_sent: int = 0  # characters already returned
    stopped: bool = False
    token_ids: list[int] = field(default_factory=list)

    @property
    def hold_back(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: the caller must end the request


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def add_request(self, request_id: str, stop: tuple[str, ...] = ()) -> None:
        self.states[request_id] = TextState(self.tokenizer.detokenizer(), tuple(stop))

    def process(self, request_id: str, new_token_ids: list[int], finished: bool) -> TextDelta:
        """Feed new tokens; returns the text that may be sent now. After a stop-string match
        the request is over: later tokens are ignored."""
        state = self.states[request_id]
        if state.stopped:
            return TextDelta("", True)
        for token in new_token_ids:
            state.token_ids.append(token)
            old_len = len(state.text)
            state.text += state.detokenizer.push(token)
            if state.stop and self._match_stop(state, old_len):
                break
        if finished and not state.stopped:
            state.text += state.detokenizer.finish()
        end = len(state.text)
        if not (finished or state.stopped):
            end = max(state.num_sent, end - state.hold_back)
        delta = state.text[state.num_sent : end]
        state.num_sent = end
        return TextDelta(delta, state.stopped)

    def text(self, request_id: str) -> str:
        return self.states[request_id].text

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @staticmethod
    def _match_stop(state: TextState, old_len: int) -> bool:
        # Only a match that ends in the new text is new: search from where it could start.
        start = max(0, old_len - state.hold_back)
        hits = [i for s in state.stop if (i := state.text.find(s, start)) >= 0]
        if not hits:
            return False
        state.text = state.text[: min(hits)]
        state.stopped = True
        return True
