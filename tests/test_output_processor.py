"""Streaming text with stop strings: held-back text, matches across tokens, nothing lost."""

import pytest

from pdserve.output_processor import OutputProcessor
from tests.router.harness import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(tokenizer, text: str, stop=()):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", tuple(stop))
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


def test_partial_stop_prefix_is_released_at_the_end(tokenizer):
    assert stream(tokenizer, "ends with EN", stop=["END"]) == ("ends with EN", False)
