"""FP8 KV: the E4M3 round-trip bound, and attention over an FP8 cache stays close to exact."""

import torch

from pdserve.model.kv_cache import Fp8LayerCache, LayerCache, dequantize_fp8, quantize_fp8


def test_fp8_round_trip_within_e4m3_bound():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 3, 64)[:, None, None]  # many magnitudes
    rows = quantize_fp8(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 3, 68)
    back = dequantize_fp8(rows, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # E4M3: 3 mantissa bits -> relative rounding error <= 2^-4 for normal values; below the
    # smallest normal (2^-6 * scale) the absolute spacing is 2^-9 * scale.
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert torch.all((back - x).abs() <= bound + 1e-12)
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # max kept


def test_zero_rows_survive():
    zeros = torch.zeros(2, 4)
    assert torch.equal(dequantize_fp8(quantize_fp8(zeros), torch.float32), zeros)


def test_fp8_cache_gather_matches_written_values():
    torch.manual_seed(1)
    exact = LayerCache(torch.zeros(8, 2, 2, 4, 16))
    fp8 = Fp8LayerCache(torch.zeros(8, 2, 2, 4, 20, dtype=torch.uint8))
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    blocks, offsets = torch.tensor([3, 3, 3, 3, 5, 5]), torch.tensor([0, 1, 2, 3, 0, 1])
    for cache in (exact, fp8):
        cache.write(k, v, blocks, offsets)
    table = torch.tensor([[3, 5]])
    ek, ev = exact.gather(table, torch.float32)
    fk, fv = fp8.gather(table, torch.float32)
    assert fp8.head_dim == exact.head_dim == 16
    torch.testing.assert_close(fk[:, :, :6], ek[:, :, :6], atol=0.13, rtol=0.07)
    torch.testing.assert_close(fv[:, :, :6], ev[:, :, :6], atol=0.13, rtol=0.07)
