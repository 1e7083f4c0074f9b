import random

import pytest
import torch

from pdserve.model.penalties import PenaltyRow, apply_penalties, penalty_row
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams


def reference(logits: torch.Tensor, rows: list[PenaltyRow]) -> torch.Tensor:
    """vLLM's penalties written as a plain loop over each row's tokens."""
    out = logits.clone()
    for r in rows:
        x = out[r.row]
        if r.repetition_penalty != 1.0:
            for t in set(r.prompt_token_ids) | set(r.output_token_ids):
                x[t] = x[t] / r.repetition_penalty if x[t] > 0 else x[t] * r.repetition_penalty
        for t in set(r.output_token_ids):
            count = list(r.output_token_ids).count(t)
            x[t] -= r.frequency_penalty * count + r.presence_penalty
        for t, bias in r.logit_bias:
            x[t] += bias
        for t in r.banned_token_ids:
            x[t] = float("-inf")
    return out


def random_rows(num_rows: int, vocab: int, seed: int) -> list[PenaltyRow]:
    rng = random.Random(seed)
    rows = []
    for row in rng.sample(range(num_rows), num_rows - 1):  # one row untouched
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        output = [rng.randrange(vocab // 4) for _ in range(rng.randrange(0, 30))]  # repeats
        rows.append(
            PenaltyRow(
                row,
                prompt,
                output,
                repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
                presence_penalty=rng.choice([0.0, 0.5, -1.0]),
                frequency_penalty=rng.choice([0.0, 0.25, 2.0]),
                logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(vocab), 3)),
                banned_token_ids=tuple(rng.sample(range(vocab), rng.randrange(0, 3))),
            )
        )
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_batched_penalties_equal_the_plain_loop(seed):
    vocab = 97
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    rows = random_rows(6, vocab, seed)
    expected = reference(logits, rows)
    apply_penalties(logits, rows)
    torch.testing.assert_close(logits, expected)


def test_repetition_divides_positive_and_multiplies_negative_logits_once():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    # Token 0 in prompt and output twice: penalized once, not three times.
    apply_penalties(logits, [PenaltyRow(0, [0, 1], [0, 0], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 2.0, 1.0]]


def test_presence_and_frequency_count_only_output_tokens():
    logits = torch.zeros(1, 4)
    row = PenaltyRow(0, [3, 3], [1, 1, 2], presence_penalty=0.5, frequency_penalty=1.0)
    apply_penalties(logits, [row])
    assert logits.tolist() == [[0.0, -2.5, -1.5, 0.0]]


def test_min_tokens_bans_eos_and_stop_ids_only_until_reached():
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(5,))
    request = Request("r", [1, 2], params, eos_token_ids=(0,))
    assert penalty_row(3, request).banned_token_ids == (0, 5)
    request.output_token_ids += [7, 8]
    assert penalty_row(3, request).banned_token_ids == ()
    ignoring = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    assert penalty_row(0, Request("r", [1], ignoring, eos_token_ids=(0,))).banned_token_ids == ()


def test_a_resumed_requests_earlier_output_counts_as_output():
    params = SamplingParams(max_tokens=8, min_tokens=3, frequency_penalty=1.0)
    request = Request("r", [1, 2, 9, 9], params, num_prior_output_tokens=2)
    request.output_token_ids.append(4)
    row = penalty_row(0, request)
    assert (list(row.prompt_token_ids), list(row.output_token_ids)) == ([1, 2], [9, 9, 4])
    assert row.banned_token_ids == ()  # three tokens out: min_tokens reached


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logit_bias": [[1, 101]]}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": [[-1, 1]]}, "logit_bias keys"),
        ({"logit_bias": [[1, 1], [1, 2]]}, "logit_bias names a token id twice"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens must be <= max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)
