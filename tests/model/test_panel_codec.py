import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf import quants

from pdserve.model import native, panel_codec
from pdserve.model.panel_codec import F32, Q4A, Q8S, QBLOCK, _q4_column_order

PANELS = [24, 48]  # the AVX2 and AVX-512 variants' widths
# A block of 32 k by P columns: (d, m) and P 4-bit q per k, or d and P int8 q per k.
BLOCK_BYTES_PER_COLUMN = {Q4A: 24, Q8S: 36}
BYTES_PER_WEIGHT = {F32: 4.0, Q4A: 24 / QBLOCK, Q8S: 36 / QBLOCK}


def decode(codec: int, data: torch.Tensor, n: int, k: int, panel: int) -> torch.Tensor:
    """The fp32 [N, K] weight back from `encode`'s panels: the reference the kernels match."""
    panels, kb = data.shape[0], k // QBLOCK
    if codec == F32:
        cols = data.transpose(1, 2)
    else:
        blocks = data.reshape(panels, kb, BLOCK_BYTES_PER_COLUMN[codec] * panel)
        floats = 4 * panel
        d = blocks[..., :floats].contiguous().view(torch.float32)  # [P, kb, panel]
        if codec == Q4A:
            m = blocks[..., floats : 2 * floats].contiguous().view(torch.float32)
            words = blocks[..., 2 * floats :].contiguous().view(torch.int32).to(torch.int64)
            words = (words & 0xFFFFFFFF).reshape(panels, kb, QBLOCK, panel // 8, 1)
            slots = ((words >> (4 * torch.arange(8))) & 0xF).reshape(panels, kb, QBLOCK, panel)
            q = torch.empty_like(slots)
            q[..., _q4_column_order(panel)] = slots
        else:
            m = torch.zeros_like(d)
            q = blocks[..., floats:].contiguous().view(torch.int8)
            q = q.reshape(panels, kb, QBLOCK, panel)
        w = torch.addcmul(m.unsqueeze(2), q.float(), d.unsqueeze(2))  # [P, kb, 32, panel]
        cols = w.reshape(panels, k, panel).transpose(1, 2)
    return cols.reshape(panels * panel, k)[:n].contiguous()


def gguf_weights(n: int, k: int, qtype: QT, seed: int = 0) -> torch.Tensor:
    """What the loader produces from a GGUF tensor: gguf's own quantize, then dequantize."""
    x = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    return torch.from_numpy(quants.dequantize(quants.quantize(x, qtype), qtype).copy())


@pytest.mark.parametrize(
    "qtype,codec", [(QT.Q4_1, Q4A), (QT.Q8_0, Q8S), (QT.Q4_0, Q8S), (QT.F32, F32)]
)
@pytest.mark.parametrize("n,k", [(48, 64), (50, 96), (7, 32)])
@pytest.mark.parametrize("panel", PANELS)
def test_encode_picks_the_smallest_lossless_format(qtype, codec, n, k, panel):
    """GGUF grids are found (Q4_0 is a symmetric grid, so it fits the 8-bit form) and the
    panels decode back bit for bit; fp32 weights stay fp32."""
    w = gguf_weights(n, k, qtype) if qtype != QT.F32 else torch.randn(n, k)
    got, data = panel_codec.encode(w, panel)
    assert got == codec
    assert torch.equal(decode(got, data, n, k, panel), w)
    panels = -(-n // panel)
    bytes_per_weight = BYTES_PER_WEIGHT[codec]
    assert data.numel() * data.element_size() == panels * k * panel * bytes_per_weight


def test_one_off_grid_weight_keeps_fp32():
    """A single weight that is not on the grid (here one ulp off) keeps the matrix fp32."""
    w = gguf_weights(24, 64, QT.Q4_1)
    w[5, 17] = torch.nextafter(w[5, 17], torch.tensor(1.0))
    assert panel_codec.encode(w, 24)[0] == F32


@pytest.mark.parametrize("panel", PANELS)
def test_constant_blocks_and_odd_k(panel):
    """All-equal blocks (d = 0) are a grid; K not a multiple of 32 never is."""
    w = gguf_weights(24, 64, QT.Q4_1)
    w[3, :32] = 0.25
    w[4] = 0.0
    codec, data = panel_codec.encode(w, panel)
    assert codec == Q4A and torch.equal(decode(codec, data, 24, 64, panel), w)
    assert panel_codec.encode(gguf_weights(24, 64, QT.Q4_1)[:, :40], panel)[0] == F32
    assert panel_codec.encode(w, panel, compact=False)[0] == F32


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 32, 100])
@pytest.mark.parametrize("n,k", [(48, 64), (61, 160), (97, 416)])
def test_compact_gemm_is_bit_identical_to_fp32_panels(lib, qtype, m, n, k):
    """Expansion reproduces the fp32 weights exactly, so the GEMM result is identical, not
    merely close, to the fp32-panel kernel's — and close to F.linear. Up to MR rows (4 or
    8) the weights are computed in registers, from 9 expanded into a buffer; 416 = 3 chunks
    of k plus a part. 100 rows: a decode worker keeps only panels, so batches past
    PANEL_M_MAX take this path too. (Batches that the AMX kernels run on tiles sum in
    another order: test_gemm_amx bounds those.)"""
    if lib.amx_m_min is not None and m >= lib.amx_m_min:
        pytest.skip(f"{m} rows take the AMX GEMM (test_gemm_amx)")
    w = gguf_weights(n, k, qtype, seed=m)
    x, b = torch.randn(m, k), torch.randn(n)
    compact, full = native.pack_panels(lib, w), native.pack_panels(lib, w, compact=False)
    assert compact.codec != F32 and full.codec == F32
    assert compact.nbytes * 3 < full.nbytes
    y = native.linear_panels(lib, x, compact, b)
    assert torch.equal(y, native.linear_panels(lib, x, full, b))
    torch.testing.assert_close(y, F.linear(x, w, b))
