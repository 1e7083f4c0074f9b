"""The model's tokenizer, as the benchmark needs it: random prompts of exact token lengths.

Uses the light ``tokenizers`` package (not ``transformers``) so the benchmark stays a small,
torch-free client that can point at any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def resolve_tokenizer_file(name_or_path: str) -> Path:
    """Find ``tokenizer.json`` for a directory, a file, a ``.gguf`` or a model name from the
    registry (which also reads a GGUF's own tokenizer).

    The registry (``pdserve.model.registry``) is imported only for a model name, so a
    tokenizer directory needs nothing beyond ``tokenizers``.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix != ".gguf":
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    from pdserve.model.registry import resolve_model

    try:
        resolved = Path(resolve_model(name_or_path, gguf_fp32_max_bytes=None)) / "tokenizer.json"
    except Exception as exc:  # the registry's own errors are not ours to classify
        raise ValueError(f"--tokenizer {name_or_path!r}: {exc}") from exc
    if resolved.is_file():
        return resolved
    raise ValueError(f"--tokenizer {name_or_path!r}: no tokenizer.json found there")


class TokenSource:
    """Samples token ids and converts between ids and text.

    ``vocab_ids`` excludes added/special tokens: a random BOS or EOS in the middle of a
    prompt would change what the server does, not just how long the prompt is.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = set(tokenizer.get_added_tokens_decoder())
        self.vocab_ids = np.array([i for i in range(size) if i not in added], dtype=np.int64)
        if self.vocab_ids.size == 0:
            raise ValueError("tokenizer has no ordinary (non-special) tokens")

    @classmethod
    def load(cls, name_or_path: str) -> TokenSource:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(resolve_tokenizer_file(name_or_path))))

    def random_ids(self, rng: np.random.Generator, n: int, text: bool = False) -> list[int]:
        """``n`` ids drawn uniformly; with ``text`` only from ids that survive decode -> encode
        on their own, so text prompts keep their length (see ``text_vocab_ids``)."""
        vocab = self.text_vocab_ids if text else self.vocab_ids
        return vocab[rng.integers(0, vocab.size, size=n)].tolist()

    def keyed_ids(self, seed: int, keys: Sequence[int], n: int) -> np.ndarray:
        """``n`` ids per key (a row each), uniform over the vocabulary, from a counter-based
        hash of (seed, key, position): a key's row is the same whatever keys are drawn with
        it, in whatever order. A trace's thousands of blocks come out in one pass, where a
        NumPy Generator per block cost ~60 us each (its seeding most of it)."""
        # Any int works as a seed or key (a trace's hash ids are not checked for sign or size).
        seeds = np.full(len(keys), seed & _U64_MASK, dtype=np.uint64)
        key = _mix64(_mix64(seeds) ^ np.array([k & _U64_MASK for k in keys], dtype=np.uint64))
        counters = key[:, None] + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
        return self.vocab_ids[_mix64(counters) % np.uint64(self.vocab_ids.size)]

    def random_prompt(self, rng: np.random.Generator, n: int, text: bool) -> tuple[list[int], str]:
        """``n`` random ids and, with ``text``, their text re-encoded to fit (``fit_text``:
        the ids are then the text's own); without, the text is ""."""
        ids = self.random_ids(rng, n, text=text)
        return self.fit_text(ids, rng) if text else (ids, "")

    @functools.cached_property
    def text_vocab_ids(self) -> np.ndarray:
        """Ids whose text re-encodes to themselves and holds no partial UTF-8 character.

        A byte-level BPE vocabulary has tokens that are a fragment of a multi-byte character;
        decoded alone they become U+FFFD, which re-encodes as three tokens. Drawing text
        prompts from the rest makes decode -> encode keep the length almost always.
        """
        ids = self.vocab_ids.tolist()
        texts = self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        keep = [
            i
            for i, text, enc in zip(ids, texts, encodings, strict=True)
            if enc.ids == [i] and "\ufffd" not in text
        ]
        return np.array(keep, dtype=np.int64) if keep else self.vocab_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def fit_text(
        self, ids: list[int], rng: np.random.Generator, max_rounds: int = 8
    ) -> tuple[list[int], str]:
        """Text whose re-encoding has ``len(ids)`` tokens: (that re-encoding, the text).

        Adjacent tokens can merge or split when re-encoded, so trim or top up the re-encoded
        ids and try again; a trim never leaves half a character at the end. If it does not
        converge the last text is returned with its true length, which callers record.
        """
        target = len(ids)
        text = self.decode(ids)
        encoded = self.encode(text)
        for _ in range(max_rounds):
            if len(encoded) == target:
                break
            ids = encoded[:target]
            while ids and self.decode(ids[-1:]).endswith("\ufffd"):
                ids = ids[:-1]
            ids = ids + self.random_ids(rng, target - len(ids), text=True)
            text = self.decode(ids)
            encoded = self.encode(text)
        return encoded, text


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U64_MASK = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic): a bijection whose
    outputs for consecutive inputs are statistically independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def join_text(left: str, right: str) -> str:
    """Concatenates prompt pieces so a word-final and a word-initial token never fuse.

    Byte-level BPE pieces usually carry their own leading space; word-level ones do not.
    Joined text prompts are therefore exact only up to the boundary token; the server's
    ``usage.prompt_tokens`` gives the true length when it reports one.
    """
    if not left or not right or left[-1].isspace() or right[0].isspace():
        return left + right
    return f"{left} {right}"
