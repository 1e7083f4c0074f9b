"""Streaming text with stop strings: held-back text, matches across tokens, nothing lost."""

import pytest

from pdserve.output_processor import OutputProcessor
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
