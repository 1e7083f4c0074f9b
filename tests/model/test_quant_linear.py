"""The GGUF block kernels (csrc/quant_gemm.c) equal the `gguf` package's dequantize followed by
a matmul, for every type they read, on every instruction-set variant this CPU runs."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pdserve.model.gguf_convert import BLOCKS
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantEmbedding, QuantLinear, QuantTensor

# Where each quantized type keeps its fp16 scales in a block (the rest: any bit pattern).
SCALES = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
          Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}  # fmt: skip


def random_tensor(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of random blocks with finite scales (any quant bits are valid)."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == Q.F32:
            return values.view(np.uint8)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    for at in SCALES[qtype]:
        scales = rng.uniform(-0.05, 0.05, n).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).astype(np.float32))


TYPES = [Q(t) for t in BLOCKS]


def test_every_listed_type_has_a_case():
    assert set(SCALES) | {Q.F32, Q.F16, Q.BF16} == set(TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 5, QUANT_GEMV_M_MAX + 7])
def test_linear_matches_dequantize_then_matmul(lib, qtype, m):
    rng = np.random.default_rng(int(qtype) * 100 + m)
    rows, cols = 37, 512  # an odd number of rows; two K-quant super-blocks a row
    data = random_tensor(qtype, rows, cols, rng)
    w = reference(data, qtype, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    y = QuantLinear(lib, [QuantTensor(data, int(qtype), rows, cols, "w")])(x)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5 * float(w.abs().max()) * 8)


@pytest.mark.parametrize("m", [1, QUANT_GEMV_M_MAX + 1])
def test_fused_parts_row_map_and_bias(lib, m):
    """Q4_K and Q6_K parts (as in a Q4_K_M file) side by side, one read through a row map."""
    rng = np.random.default_rng(7)
    a, b = random_tensor(Q.Q4_K, 8, 256, rng), random_tensor(Q.Q6_K, 5, 256, rng)
    rowmap = torch.tensor([3, 1, 0, 7, 2, 6, 5, 4])
    bias = torch.randn(13)
    linear = QuantLinear(
        lib,
        [QuantTensor(a, int(Q.Q4_K), 8, 256, "a", rowmap), QuantTensor(b, int(Q.Q6_K), 5, 256)],
        bias,
    )
    w = torch.cat([reference(a, Q.Q4_K, 8, 256)[rowmap], reference(b, Q.Q6_K, 5, 256)])
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    # fp32 sums of 256 products in another order: an error relative to the largest weight
    torch.testing.assert_close(linear(x), x @ w.T + bias, rtol=1e-5, atol=1e-4 * w.abs().max())


def test_embedding_dequantizes_the_looked_up_rows(lib):
    rng = np.random.default_rng(3)
    data = random_tensor(Q.Q6_K, 11, 256, rng)
    embedding = QuantEmbedding(lib, QuantTensor(data, int(Q.Q6_K), 11, 256, "token_embd"))
    ids = torch.tensor([[4, 0, 10], [4, 4, 1]])
    expected = reference(data, Q.Q6_K, 11, 256)[ids]
    assert torch.equal(embedding(ids), expected)
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([11]))


def test_wrong_byte_shape_is_refused():
    data = np.zeros((4, 100), np.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        QuantTensor(data, int(Q.Q4_K), 4, 256, "blk.0.attn_q.weight")
