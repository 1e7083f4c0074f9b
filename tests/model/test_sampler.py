import math

import pytest
import torch

from pdserve.model.sampler import CDF_BLOCK, SamplingRow, inverse_cdf, sample


def row(temperature=1.0, top_k=0, top_p=1.0, seed=None, output_index=0):
    return SamplingRow(temperature, top_k, top_p, seed, output_index)


@pytest.mark.parametrize("vocab", [7, CDF_BLOCK, CDF_BLOCK + 1, 3 * CDF_BLOCK - 5])
def test_inverse_cdf_draws_each_token_with_its_probability(vocab):
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(2, vocab, generator=g) ** 4  # uneven, unnormalized
    probs[:, ::3] = 0.0  # zero-probability tokens, including in the first block
    n = 40_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    for r in range(2):
        picks = inverse_cdf(probs[r].expand(n, vocab), u)
        counts = torch.bincount(picks, minlength=vocab).double()
        expected = probs[r].double() / probs[r].double().sum() * n
        assert counts[::3].sum() == 0  # never a zero-probability token
        assert counts.sum() == n and picks.max() < vocab
        # Chi-square against the distribution (nonzero bins): far below any real mismatch.
        live = expected > 0
        chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum().item()
        dof = int(live.sum()) - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


def test_inverse_cdf_at_the_edges_of_the_unit_interval():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    below_one = torch.tensor([1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, torch.zeros(1, dtype=torch.float64)).item() == 1
    assert inverse_cdf(probs, below_one).item() == 3  # not the zero-probability tail
    one_hot = torch.zeros(1, 3 * CDF_BLOCK)
    one_hot[0, CDF_BLOCK + 17] = 1e-30  # tiny but positive: the only token there is
    for u in (0.0, 0.5, 1.0 - 2**-53):
        assert inverse_cdf(one_hot, torch.tensor([u], dtype=torch.float64)).item() == CDF_BLOCK + 17


def test_sample_follows_temperature_and_keeps_greedy_rows_exact():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(3, 1)
    rows = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.5)]
    n = 20_000
    counts = torch.zeros(3, 4)
    for _ in range(n // 100):
        batch = sample(logits.repeat(100, 1), rows * 100, g)  # a fresh copy: overwritten
        for b, token in enumerate(batch):
            counts[b % 3, token] += 1
    assert counts[0].tolist() == [n, 0, 0, 0]
    for r, t in ((1, 1.0), (2, 0.5)):
        expected = (logits[0] / t).softmax(-1) * n
        assert torch.allclose(counts[r], expected, atol=5 * expected.sqrt().max().item())


def test_top_k_and_top_p_exclude_their_tokens():
    g = torch.Generator().manual_seed(2)
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]])
    seen_k, seen_p = set(), set()
    for _ in range(500):
        seen_k.add(sample(logits.clone(), [row(top_k=2)], g)[0])
        seen_p.add(sample(logits.clone(), [row(top_p=0.5)], g)[0])
    assert seen_k == {0, 1}
    assert seen_p <= {0, 1} and 0 in seen_p


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    seeded = row(seed=42, output_index=5)
    alone = sample(logits[2:3].clone(), [seeded], torch.Generator().manual_seed(0))
    others = [row(), row(temperature=0.0), seeded, row(seed=7)]
    batched = sample(logits, others, torch.Generator().manual_seed(99))
    assert batched[2] == alone[0]
