import pytest

from pdserve.kvcache.dropping import DropPolicy, blocks_to_drop

POLICY = DropPolicy(budget_blocks=6, sink_blocks=1, recent_blocks=2)


def test_within_budget_drops_nothing():
    assert blocks_to_drop([0.0] * 6, next_needs_block=False, policy=POLICY) == []


def test_drops_lowest_scores_between_sink_and_recent():
    #            sink  a    b    c    d  | recent recent | filling
    scores = [0.0, 5.0, 1.0, 3.0, 0.5, 9.0, 9.0, 0.0]
    # 8 blocks, the next token needs a 9th: keep 5 -> drop 3 of blocks 1..4, lowest first.
    assert blocks_to_drop(scores, next_needs_block=True, policy=POLICY) == [2, 3, 4]
    assert blocks_to_drop(scores, next_needs_block=False, policy=POLICY) == [2, 4]


def test_sink_and_recent_are_never_dropped_even_with_lowest_scores():
    scores = [0.0, 9.0, 9.0, 9.0, 0.0, 0.0, 0.0]
    assert blocks_to_drop(scores, next_needs_block=False, policy=POLICY) == [1]


def test_budget_must_leave_room():
    with pytest.raises(ValueError, match="at least 5 blocks"):
        DropPolicy(budget_blocks=4, sink_blocks=1, recent_blocks=2)
