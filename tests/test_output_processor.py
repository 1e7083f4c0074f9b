"""Streaming text with stop strings: held-back text, matches across tokens, nothing lost."""

import random

import pytest

from pdserve.output_processor import ByteTable, OutputProcessor, TableDetokenizer, _byte_decoder
from tests.router.harness import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(tokenizer, text: str, stop=(), min_tokens=0):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", tuple(stop), min_tokens)
    ids = tokenizer.encode(text)
    out = []
    for i, token in enumerate(ids):
        delta = proc.process("r", [token], finished=i == len(ids) - 1)
        out.append(delta.text)
        if delta.stopped:
            return "".join(out), True
    return "".join(out), False


def test_no_stop_returns_everything(tokenizer):
    assert stream(tokenizer, "hello wörld ✓") == ("hello wörld ✓", False)


def test_stop_string_spanning_tokens_is_cut_and_not_returned(tokenizer):
    text, stopped = stream(tokenizer, "The answer is 42. END more", stop=["END"])
    assert stopped and text == "The answer is 42. "


def test_earliest_of_several_stops_wins(tokenizer):
    text, stopped = stream(tokenizer, "abc STOP xyz HALT", stop=["HALT", "STOP"])
    assert stopped and text == "abc "


def test_no_stop_string_ends_within_min_tokens(tokenizer):
    """vLLM's rule: a stop string counts once the output holds more than min_tokens tokens,
    and only a match ending in a token from then on (one already passed is not found later)."""
    text = "ab END cd END ef"
    assert len(tokenizer.encode(text)) == len(text)  # one token per character here
    assert stream(tokenizer, text, ["END"], min_tokens=5) == ("ab ", True)  # ends in token 6
    assert stream(tokenizer, text, ["END"], min_tokens=6) == ("ab END cd ", True)
    assert stream(tokenizer, text, ["END"], min_tokens=13) == (text, False)


def test_partial_stop_prefix_is_released_at_the_end(tokenizer):
    assert stream(tokenizer, "ends with EN", stop=["END"]) == ("ends with EN", False)


def test_kept_text_stays_within_the_hold_back_however_long_the_output(tokenizer):
    # Per-token work is a search of the kept tail, so the tail must not grow with the output.
    stop = ("x" * 40, "STOP")
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", stop)
    out = []
    for token in tokenizer.encode("ab " * 2000):
        out.append(proc.process("r", [token], finished=False).text)
        assert len(proc.states["r"].pending) <= 39
    out.append(proc.process("r", tokenizer.encode("STOP tail"), finished=False).text)
    assert "".join(out) == "ab " * 2000 and proc.states["r"].stopped


def test_a_batch_of_tokens_gives_what_one_at_a_time_gives(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", ("END",))
    delta = proc.process("r", tokenizer.encode("The answer is 42. END more"), finished=False)
    assert (delta.text, delta.stopped) == ("The answer is 42. ", True)


def _deltas(proc, tokenizer, ids, stop=()):
    proc.add_request("r", tuple(stop))
    out = [proc.process("r", [t], finished=False) for t in ids]
    out.append(proc.process("r", [], finished=True))
    proc.remove("r")
    return [(d.text, d.stopped) for d in out]


class _HFOnly(OutputProcessor):
    """The processor as it was: every window decoded through the HF tokenizer."""

    def detokenizer(self):
        return self.tokenizer.detokenizer()


def test_a_byte_level_tokenizer_streams_from_the_byte_table(tokenizer):
    assert isinstance(OutputProcessor(tokenizer).detokenizer(), TableDetokenizer)


TRICKY = [
    "plain ascii, spaces  and\ttabs\n",
    "naïve café ✓ 日本語 🤖👩‍👩‍👧",  # 2-, 3- and 4-byte characters split across byte tokens
    " leading space, trailing space ",
]


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("stop", [(), ("✓ 日",), ("ce,", "🤖")])
def test_table_deltas_are_the_hf_detokenizers_delta_for_delta(tokenizer, text, stop):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode(text)
    ids = ids[:5] + [eos] + ids[5:] + [eos]  # a special token mid-stream is skipped by both
    fast = _deltas(OutputProcessor(tokenizer), tokenizer, ids, stop)
    assert fast == _deltas(_HFOnly(tokenizer), tokenizer, ids, stop)


def test_table_decodes_broken_utf8_as_the_hf_tokenizer_does(tokenizer):
    # One token per byte: random bytes give every kind of invalid and truncated sequence,
    # and the held-back U+FFFD runs the detokenizer must give up on after 8 tokens.
    rng = random.Random(0)
    byte_ids = tokenizer.encode("".join(chr(c) for c in range(32, 127)))
    table = ByteTable.build(tokenizer)
    special = tokenizer.eos_token_ids[0]
    for _ in range(300):
        ids = [rng.choice([*byte_ids, special, 10**6]) for _ in range(rng.randrange(1, 12))]
        raw = bytes(rng.randrange(128, 256) for _ in range(rng.randrange(0, 12)))
        ids += [tokenizer.encode(chr(b))[0] if b < 128 else _byte_token(tokenizer, b) for b in raw]
        assert table.decode(ids) == tokenizer.decode(ids)
        fast = _deltas(OutputProcessor(tokenizer), tokenizer, ids)
        assert fast == _deltas(_HFOnly(tokenizer), tokenizer, ids)


def _byte_token(tokenizer, byte: int) -> int:
    """The tiny tokenizer's id of one raw byte (its vocabulary is GPT-2's byte alphabet)."""
    char = next(c for c, b in _byte_decoder().items() if b == byte)
    return tokenizer.backend.convert_tokens_to_ids(char)


def test_a_tokenizer_that_is_not_byte_level_keeps_the_hf_detokenizer(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

    vocab = {"<unk>": 0, "▁a": 1, "▁b": 2, "a": 3}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast"}'
    )
    sentencepiece_like = Tokenizer(tmp_path)
    assert ByteTable.build(sentencepiece_like) is None
    detokenizer = OutputProcessor(sentencepiece_like).detokenizer()
    assert type(detokenizer) is IncrementalDetokenizer
