import pytest

from pdserve.kvcache.dropping import DropPolicy, PromptDrop, blocks_to_drop, over_budget

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


@pytest.mark.parametrize("num_tokens", range(1, 60))
@pytest.mark.parametrize("budget_tokens", [20, 23, 32])
def test_prompt_drop_is_the_drop_right_after_the_prompt(num_tokens, budget_tokens):
    """Dropping before the transfer keeps exactly as many blocks as the collocated drop
    right after the prompt's last chunk, and only when that drop frees any (over_budget)."""
    bs = 4
    policy = DropPolicy(budget_tokens // bs, sink_blocks=1, recent_blocks=2)
    num_blocks = -(-num_tokens // bs)
    victims = blocks_to_drop([1.0] * num_blocks, num_tokens % bs == 0, policy)
    drop = policy.prompt_drop(num_tokens, bs)
    assert (drop is not None) == bool(victims) == over_budget(num_tokens, budget_tokens, bs)
    if drop is not None:
        assert drop.num_keep_blocks == num_blocks - len(victims)
        assert drop.num_dropped_tokens(num_tokens, bs) == len(victims) * bs
        assert drop.kept([1.0] * num_blocks) == [i for i in range(num_blocks) if i not in victims]


def test_prompt_drop_keeps_sink_recent_and_the_best_in_order():
    scores = [0.0, 1.0, 7.0, 2.0, 3.0, 0.5, 0.5, 0.5]
    assert PromptDrop(5, 1, 2).kept(scores) == [0, 2, 5, 6, 7]
    assert PromptDrop(6, 1, 2).kept(scores) == [0, 2, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 1, 2), "at least 4"),
        ((5, -1, 2), "sink_blocks"),
        ((True, 1, 2), "num_keep_blocks"),
        ((5, 1, "2"), "recent_blocks"),
    ],
)
def test_prompt_drop_validates(args, match):
    with pytest.raises(ValueError, match=match):
        PromptDrop(*args)
    with pytest.raises(ValueError, match="drops nothing"):
        PromptDrop(5, 1, 2).kept([1.0] * 5)
