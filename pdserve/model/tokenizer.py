"""Text <-> token ids for one model, plus incremental detokenization for streaming.

A thin wrapper over the HF tokenizer saved in the model directory. It fixes the few choices the
server must make the same way everywhere: special tokens are never added implicitly (BOS only
when the model's tokenizer_config says `add_bos_token`), chat messages are validated before the
template runs, and the set of end-of-sequence ids merges every place a model may declare them.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from pdserve.model.registry import resolve_model

_REPLACEMENT_CHAR = "\ufffd"
# Longest run of tokens that can end mid-character: a UTF-8 character is at most 4 bytes and
# a byte-level (or byte-fallback) token at least one, so a longer run holding U+FFFD is broken
# output, emitted as is instead of growing the decode window without bound.
_MAX_HELD_TOKENS = 8


class Tokenizer:
    """The tokenizer of one HF-format model directory (local files only)."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        try:
            self._tokenizer = _load_hf_tokenizer(model_dir)
        except Exception as exc:
            raise ValueError(f"cannot load a tokenizer from {model_dir} ({exc})") from exc
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token_id: int | None = self._tokenizer.bos_token_id
        self.add_bos = bool(tokenizer_config.get("add_bos_token")) and self.bos_token_id is not None
        self.eos_token_ids: list[int] = _eos_token_ids(
            _read_json(model_dir / "generation_config.json"),
            _read_json(model_dir / "config.json"),
            self._tokenizer.eos_token_id,
        )
        self.vocab_size: int = len(self._tokenizer)
        vocab = self._tokenizer.get_vocab()
        # Upper bound on the characters one token covers (byte-level token strings have one
        # char per byte, and a character is at least one byte): N characters of text are at
        # least N / max_token_chars tokens, which lets the router refuse long text unencoded.
        self.max_token_chars: int = max(map(len, vocab), default=1)
        specials = [t.content for t in self._tokenizer.added_tokens_decoder.values() if t.special]
        # A special token's text encoded as ordinary text (the only place the stateful
        # split_special_tokens switch is used: here, before any concurrent encode).
        self._special_text_ids = {
            s: self._tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
            for s in specials
        }
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first))) if specials else None

    @property
    def backend(self) -> Any:
        """The HF tokenizer underneath (llguidance builds its token tables from it)."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; BOS is prepended only if the model asks for it."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (eos, chat markers) are dropped by default."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The template's Jinja source (router/tools.py reads the family's tool format)."""
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) else None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Prompt ids for a chat, ending with the assistant's generation prompt; `tools`
        (OpenAI's tool list) go to a template that renders them.

        The template writes every special token itself, so the rendered text is encoded
        without adding any. Message fields are text: a special token's string typed in them
        (`<|im_end|>`) stays text and never becomes the control token, as OpenAI's API does
        and unlike vLLM, which encodes the whole rendered template with special tokens
        parsed. Each such string is swapped for an unguessable placeholder before rendering
        and encoded as text in its place; requests without one are encoded exactly as vLLM.
        """
        _check_messages(messages)
        if not self._tokenizer.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        marker = f"\ue000{secrets.token_hex(8)}\ue001"
        typed: list[str] = []

        def shield(match: re.Match[str]) -> str:
            typed.append(match.group())
            return f"{marker}{len(typed) - 1}{marker}"

        if self._special_re is not None:
            messages = [
                {
                    k: v
                    if k == "role" or not isinstance(v, str)
                    else self._special_re.sub(shield, v)
                    for k, v in message.items()
                }
                for message in messages
            ]
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors, including the template's own raise_exception
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        pieces = text.split(marker) if typed else [text]
        ids: list[int] = []
        for index, piece in enumerate(pieces):  # odd pieces are indexes into `typed`
            if index % 2:
                ids += self._special_text_ids[typed[int(piece)]]
            elif piece:
                ids += self._tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one request."""
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a request's token stream into text deltas whose concatenation is the full text.

    A multi-byte character may span several byte-level tokens; until its last byte arrives the
    tail decodes to U+FFFD, so output is held back. Each push decodes only a short window: the
    tokens since the last emitted point plus the window before it, whose text is subtracted.
    Decoding with that context, instead of the new tokens alone, keeps tokenizers that treat a
    leading space specially (sentencepiece) exact.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        held = len(self._ids) - self._read_offset
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and held < _MAX_HELD_TOKENS
        ):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def finish(self) -> str:
        """Text still held back at the end of the request (e.g. a dangling partial char)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end])


def load_tokenizer(name_or_path: str, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a known model name, `.gguf` file or HF directory."""
    return Tokenizer(resolve_model(name_or_path, cache_dir, gguf_fp32_max_bytes=None))


def _load_hf_tokenizer(model_dir: Path) -> Any:
    """The HF tokenizer of `model_dir`, without importing torch when that can be avoided.

    The router tokenizes and must stay torch-free; AutoTokenizer imports torch (through the
    model-config machinery) while the fast-tokenizer class does not. With a tokenizer.json the
    two load the same tokenizer; without one (sentencepiece-only repos) AutoTokenizer is needed.
    """
    if (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _check_messages(messages: Any) -> None:
    """ValueError naming the first malformed message, before the template sees it."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{index}] is missing '{field}'")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise ValueError(f"messages[{index}].{field} must be a string, got {kind}")


def _eos_token_ids(
    generation_config: dict[str, Any], config: dict[str, Any], tokenizer_eos: int | None
) -> list[int]:
    """End-of-sequence ids from every source, in priority order, without duplicates."""
    ids: list[int] = []
    for value in (generation_config.get("eos_token_id"), config.get("eos_token_id"), tokenizer_eos):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the optional file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}
