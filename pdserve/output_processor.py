"""Token ids -> streamed text, with stop strings. Torch-free: the offline `LLM` and the
router both use it.

Stop strings are matched on text, so a match may end mid-token and may span tokens. While a
request runs, the last `max(len(stop)) - 1` characters are held back: they could still turn
out to start a stop string, and OpenAI-style APIs never return the stop string itself.

Work per token is bounded whatever the request's length: only the unsent tail is kept, and
it never exceeds the held-back characters plus one step's new text, so each token costs
O(num_stop * (hold_back + new text)), never a pass over everything generated so far.

Detokenizing is `IncrementalDetokenizer`'s window algorithm. For a byte-level BPE tokenizer
(GPT-2's decoder: Llama 3, Qwen, SmolLM) its window is decoded here from a table of each
token's bytes (`ByteTable`) instead of through the HF tokenizer: the same text, a token's
`process()` 2.3 us instead of 5.9 (warm, SmolLM2's tokenizer); the HF path held the GIL in
13% of py-spy's samples of the router at batch 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class ByteTable:
    """The bytes of each token id as a byte-level decoder writes them, special tokens empty
    (they are skipped), so that decoding ids is a join and one UTF-8 decode. `build()` gives
    one only where that is exactly the HF tokenizer's `decode(ids, skip_special_tokens=True)`:
    the decoder is ByteLevel alone and no clean-up of spaces follows it."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> ByteTable | None:
        backend = getattr(tokenizer, "backend", None)
        fast = getattr(backend, "backend_tokenizer", None)
        if fast is None or getattr(backend, "clean_up_tokenization_spaces", True):
            return None
        decoder = json.loads(fast.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        special = {t.content for t in fast.get_added_tokens_decoder().values() if t.special}
        chars = _byte_decoder()
        token_bytes = []
        for token_id in range(fast.get_vocab_size(with_added_tokens=True)):
            token = fast.id_to_token(token_id)
            if token is None or token in special:
                token_bytes.append(b"")
            elif all(c in chars for c in token):
                token_bytes.append(bytes(chars[c] for c in token))
            else:  # as tokenizers' ByteLevel decoder: a token off the alphabet is its UTF-8
                token_bytes.append(token.encode())
        return cls(token_bytes)

    def decode(self, ids: list[int]) -> str:
        table, size = self.token_bytes, len(self.token_bytes)
        # An id past the vocabulary (a padded embedding row) decodes to nothing, as in HF.
        data = b"".join([table[i] if 0 <= i < size else b"" for i in ids])
        return data.decode("utf-8", "replace")


class TableDetokenizer(IncrementalDetokenizer):
    """`IncrementalDetokenizer` whose windows are decoded from a `ByteTable`."""

    def __init__(self, tokenizer: Tokenizer, table: ByteTable) -> None:
        super().__init__(tokenizer)
        self._table = table

    def _decode(self, start: int, end: int) -> str:
        return self._table.decode(self._ids[start:end])


_UNBUILT = object()


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
        self._table: ByteTable | None | Any = _UNBUILT

    def detokenizer(self) -> IncrementalDetokenizer:
        """A request's detokenizer: from the byte table where the tokenizer has one."""
        if self._table is _UNBUILT:
            self._table = ByteTable.build(self.tokenizer)
        if self._table is None:
            return self.tokenizer.detokenizer()
        return TableDetokenizer(self.tokenizer, self._table)

    def add_request(self, request_id: str, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        hold_back = max((len(s) for s in stop), default=1) - 1
        detokenizer = self.detokenizer()
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
