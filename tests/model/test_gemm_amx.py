"""The AMX GEMM of compact panels (csrc/gemm_amx.c) against float64, where the CPU has AMX."""

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from pdserve.model import native, panel_codec
from pdserve.model.cpu_linear import PackedLinear
from tests.model.test_panel_codec import gguf_weights

U = 2.0**-24  # fp32's unit roundoff


@pytest.fixture(scope="module")
def amx():
    lib = native.load("amx")
    if lib is None:
        pytest.skip("this CPU (or kernel) has no AMX bf16 tiles, or Linux refused their state")
    return lib


def error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What fp32 may lose on y = x w^T + b with w = d q + m per 32-k block (gguf's Q4_1 puts
    q = 0 at a block's minimum, so m is that minimum; Q8_0 has m = 0 and its minimum at
    least as low, clamped here): the products x q are exact (x split into three bf16
    terms), so only additions round — at most 32 in a block's tile sum S and its row sum
    R, one each for d S, m R and their sum, one per block in the running total, and the
    bias: fewer than K/32 + 36 roundings of terms bounded by sum |x| (|d q| + |m|)."""
    n, k = w.shape
    m = w.view(n, k // 32, 32).amin(-1, keepdim=True).clamp(max=0)
    terms = ((w.view(n, k // 32, 32) - m).abs() + m.abs()).view(n, k)
    scale = x.double().abs() @ terms.double().T + b.double().abs()
    return (k // 32 + 36) * U * scale


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 15, 16, 17, 33, 100, 513])
@pytest.mark.parametrize("n,k", [(61, 32), (100, 96), (145, 576)])
def test_amx_gemm_within_fp32_error_of_float64(amx, qtype, m, n, k):
    """Every row-tile tail (M not a multiple of 16), column tail (N not one of 48), and
    both compact formats; rows below amx.amx_m_min run the AVX-512 kernel, within the same
    bound. That bound is loose (errors reach ~2% of it); the second check is the sharp one:
    in total the error is within 4x of fp32 F.linear's (measured 0.3-1.7x; two bf16 terms
    per x instead of three measured 8-47x)."""
    w = gguf_weights(n, k, qtype, seed=m + n)
    g = torch.Generator().manual_seed(m * n + k)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = native.pack_panels(amx, w)
    assert packed.codec != panel_codec.F32
    y = native.linear_panels(amx, x, packed, b)
    err = (y.double() - (x.double() @ w.double().T + b.double())).abs()
    assert (err <= error_bound(x, w, b)).all(), (err / error_bound(x, w, b)).max()
    fp32_err = (F.linear(x, w, b).double() - (x.double() @ w.double().T + b.double())).abs()
    assert err.sum() <= 4 * fp32_err.sum()


def test_amx_keeps_one_copy_for_compact_weights(amx):
    """Compact panels take every size of input on AMX, so no oneDNN copy is kept; fp32 panels
    (not exactly splittable) keep oneDNN for prefill-sized inputs, and on a prefill worker
    (decode=False) only it."""

    def fp32_linear():
        return torch.nn.Linear(64, 100)

    compact = torch.nn.Linear(64, 100, bias=False)
    compact.weight.data = gguf_weights(100, 64, QT.Q4_1)
    packed = PackedLinear(compact, amx)
    assert packed.packed_weight is None and native.panels_take_any_rows(amx, packed.panel_weight)
    x = torch.randn(native.PANEL_M_MAX + 100, 64)
    torch.testing.assert_close(packed(x), compact(x).detach())
    fp32 = PackedLinear(fp32_linear(), amx)
    assert fp32.packed_weight is not None and fp32.panel_weight is not None
    prefill = (
        PackedLinear(compact, amx, decode=False),
        PackedLinear(fp32_linear(), amx, decode=False),
    )
    assert prefill[0].panel_weight is not None and prefill[0].packed_weight is None
    assert prefill[1].panel_weight is None and prefill[1].packed_weight is not None
