"""The GGUF block kernels (csrc/quant_gemm.c) equal the `gguf` package's dequantize followed by
a matmul, for every type they read, on every instruction-set variant this CPU runs; with int8
activations (csrc/quant_dot.c) they equal the same integer algorithm done in numpy, and stay
within the activation rounding's bound of the fp32 matmul."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pdserve.model import quant_linear
from pdserve.model.gguf_convert import BLOCKS
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantEmbedding, QuantLinear, QuantTensor

# Where each quantized type keeps its fp16 scales in a block (the rest: any bit pattern).
SCALES = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


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


# Types with an integer dot product, and the values each activation scale covers for them.
INT8 = {Q.Q8_0: 32, Q.Q4_K: 256, Q.Q6_K: 256}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 5, QUANT_GEMV_M_MAX + 7])
def test_linear_matches_dequantize_then_matmul(lib, qtype, m, monkeypatch):
    """The fp32 kernels (every type; the int8 ones with int8 activations switched off)."""
    monkeypatch.setattr(quant_linear, "AMX_TILES", False)
    if qtype in INT8:
        monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    rng = np.random.default_rng(int(qtype) * 100 + m)
    rows, cols = 37, 512  # an odd number of rows; two K-quant super-blocks a row
    data = random_tensor(qtype, rows, cols, rng)
    w = reference(data, qtype, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    y = QuantLinear(lib, [QuantTensor(data, int(qtype), rows, cols, "w")])(x)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5 * float(w.abs().max()) * 8)


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 as csrc/quant_dot.c quantizes it: per `block` values d = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)) in fp32. Returns q (int8) and d (fp32) [M, K/block]."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8).reshape(x.shape)
    return q, (amax / np.float32(127)).astype(np.float32)[..., 0]


def int8_reference(w: torch.Tensor, x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The integer algorithm in float64 (exact sums of the same int8 activations against
    the dequantized weights), and the scale of its fp32 rounding: |W| |x_q| per output."""
    q, d = quantize_activations(x.numpy(), block)
    xq = (q.reshape(*d.shape, block) * d[..., None].astype(np.float64)).reshape(q.shape)
    w64 = w.numpy().astype(np.float64)
    return xq @ w64.T, np.abs(xq) @ np.abs(w64).T


def rounding_bound(w: torch.Tensor, x: torch.Tensor, block: int) -> np.ndarray:
    """max |y_int8 - y_fp32| per output: each |x - q d| <= d / 2, so over a block the dot
    product moves by at most sum |w_i| d / 2."""
    _, d = quantize_activations(x.numpy(), block)
    w_abs = np.abs(w.numpy().astype(np.float64)).reshape(w.shape[0], -1, block).sum(-1)
    return d.astype(np.float64) / 2 @ w_abs.T


def test_activation_quantization_matches_numpy(lib):
    k = 512
    x = torch.randn(k) * torch.linspace(0.01, 30, k)
    x[256:288] = 0  # an all-zero block quantizes to zeros with scale 0
    buf = np.zeros(lib.pd_q8_row_bytes(k), np.uint8)
    lib.pd_q8_quantize(x.data_ptr(), k, buf.ctypes.data)
    q256, d256 = quantize_activations(x[None].numpy(), 256)
    q32, d32 = quantize_activations(x[None].numpy(), 32)
    assert np.array_equal(buf[:k].view(np.int8), q256[0])
    assert np.array_equal(buf[k : 2 * k].view(np.int8), q32[0])
    assert np.array_equal(buf[2 * k : 2 * k + 8].view(np.float32), d256[0])
    assert np.array_equal(buf[2 * k + 64 : 2 * k + 128].view(np.float32), d32[0])
    bsum = buf[2 * k + 128 : 2 * k + 192].view(np.int16)
    assert np.array_equal(bsum, q256[0].reshape(-1, 16).sum(-1, dtype=np.int16))
    sum32 = buf[2 * k + 192 : 2 * k + 224].view(np.int16)
    assert np.array_equal(sum32, q32[0].reshape(-1, 32).sum(-1, dtype=np.int16))
    bsum32 = buf[2 * k + 256 : 2 * k + 288].view(np.int16)
    assert np.array_equal(bsum32, q256[0].reshape(-1, 32).sum(-1, dtype=np.int16))


@pytest.mark.parametrize("qtype", list(INT8), ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, QUANT_GEMV_M_MAX])
def test_int8_dot_matches_integer_reference(lib, qtype, m, monkeypatch):
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)  # batches too
    rng = np.random.default_rng(int(qtype) * 10 + m)
    rows, cols = 37, 768
    data = random_tensor(qtype, rows, cols, rng)
    w = reference(data, qtype, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    y = QuantLinear(lib, [QuantTensor(data, int(qtype), rows, cols, "w")])(x).numpy()
    exact, scale = int8_reference(w, x, INT8[qtype])
    # fp32 rounding only (measured 3e-8 of the scale): one activation a quantum off is ~1e-5
    assert np.all(np.abs(y - exact) <= 1e-6 * scale)
    # and against the fp32 matmul, within the activation rounding's bound (+ fp32 sums)
    err = np.abs(y - (x @ w.T).numpy())
    bound = rounding_bound(w, x, INT8[qtype]) + 1e-6 * scale
    assert np.all(err <= bound)
    assert err.max() > 0  # int8 activations did run


@pytest.mark.parametrize("m", [1, 4])
def test_int8_q8_0_odd_block_count(lib, m, monkeypatch):
    """The AVX-512 Q8_0 kernel takes two blocks a vector; a row of an odd number of blocks
    ends with one block on its own (25 here)."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    rng = np.random.default_rng(25 + m)
    rows, cols = 9, 25 * 32
    data = random_tensor(Q.Q8_0, rows, cols, rng)
    w = reference(data, Q.Q8_0, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    y = QuantLinear(lib, [QuantTensor(data, int(Q.Q8_0), rows, cols, "w")])(x).numpy()
    exact, scale = int8_reference(w, x, 32)
    assert np.all(np.abs(y - exact) <= 1e-6 * scale)


@pytest.mark.parametrize("qtype", list(INT8), ids=lambda q: q.name)
def test_int8_rows_of_a_batch_equal_each_row_alone(lib, qtype, monkeypatch):
    """The integer kernels take up to 4 activation rows per pass over a weight row, each with
    its own accumulators in the same order: a row's result is bit for bit the same alone and
    in any batch (3 = a pass of 3, 7 = 4 + 3, 16 = four passes of 4)."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    rng = np.random.default_rng(int(qtype))
    data = random_tensor(qtype, 21, 512, rng)
    linear = QuantLinear(lib, [QuantTensor(data, int(qtype), 21, 512, "w")])
    x = torch.randn(QUANT_GEMV_M_MAX, 512, generator=torch.Generator().manual_seed(3)) * 2
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    for m in (2, 3, 7, QUANT_GEMV_M_MAX):
        assert torch.equal(linear(x[:m]), alone[:m])


@pytest.mark.parametrize(
    "with_vnni,without", [("amx", "avx512"), ("avx512vnni", "avx512"), ("avx2vnni", "avx2")]
)
def test_vnni_build_equals_the_one_without(with_vnni, without, monkeypatch):
    """The VNNI variants' integer sums take vpdpwssd / vpdpbusd (AVX512_VNNI, or AVX-VNNI on
    AVX2) where the others add madd's products: the same integers, so bit-identical results
    (random Q8_0 bytes include -128, the one quant whose magnitude needs all 8 unsigned bits;
    17 Q8_0 blocks a row, so the 512-bit kernel's odd last block is in too)."""
    from pdserve.model import native

    vnni, plain = native.load(with_vnni), native.load(without)
    if vnni is None or plain is None:
        pytest.skip(f"needs the {with_vnni} and {without} native kernels")
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    rng = np.random.default_rng(13)
    for qtype in INT8:
        k = 544 if qtype == Q.Q8_0 else 512
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(13)) * 4
        data = random_tensor(qtype, 19, k, rng)
        weight = [QuantTensor(data, int(qtype), 19, k)]
        assert torch.equal(QuantLinear(vnni, weight)(x), QuantLinear(plain, weight)(x)), qtype


def test_int8_up_to_int8_m_max_rows_by_default(lib, monkeypatch):
    rng = np.random.default_rng(2)
    data = random_tensor(Q.Q4_K, 4, 256, rng)
    w = reference(data, Q.Q4_K, 4, 256)
    linear = QuantLinear(lib, [QuantTensor(data, int(Q.Q4_K), 4, 256, "w")])
    m = quant_linear.INT8_M_MAX
    x = torch.randn(m + 1, 256, generator=torch.Generator().manual_seed(2))
    exact, scale = int8_reference(w, x[:m], 256)
    assert np.all(np.abs(linear(x[:m]).numpy() - exact) <= 1e-6 * scale)
    # one more: AMX tiles, or int8 up to INT8_MANY_M_MAX rows (tests below), else fp32
    assert linear.amx_tiles == hasattr(lib, "pd_quant_linear_amx") != linear.int8_many_rows
    monkeypatch.setattr(quant_linear, "AMX_TILES", False)
    monkeypatch.setattr(quant_linear, "INT8_MANY_M_MAX", 0)
    torch.testing.assert_close(linear(x), x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, QUANT_GEMV_M_MAX + 1])
def test_fused_parts_row_map_and_bias(lib, m, monkeypatch):
    """Q4_K and Q6_K parts (as in a Q4_K_M file) side by side, one read through a row map
    (the fp32 kernels)."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    monkeypatch.setattr(quant_linear, "AMX_TILES", False)
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


def test_fused_parts_int8_with_row_map(lib, monkeypatch):
    """A fused Q4_K | Q6_K | Q4_0 linear with int8 activations: the first two take integer
    dot products (one through its row map), Q4_0 stays on the fp32 kernel."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    rng = np.random.default_rng(11)
    k = 512
    shapes = ((Q.Q4_K, 8), (Q.Q6_K, 5), (Q.Q4_0, 3))
    a, b, c = (random_tensor(t, n, k, rng) for t, n in shapes)
    rowmap = torch.tensor([3, 1, 0, 7, 2, 6, 5, 4])
    parts = [QuantTensor(a, int(Q.Q4_K), 8, k, "a", rowmap)]
    parts += [QuantTensor(b, int(Q.Q6_K), 5, k), QuantTensor(c, int(Q.Q4_0), 3, k)]
    linear = QuantLinear(lib, parts)
    wa = reference(a, Q.Q4_K, 8, k)[rowmap]
    wb, wc = reference(b, Q.Q6_K, 5, k), reference(c, Q.Q4_0, 3, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    y = linear(x).numpy()
    exact, scale = int8_reference(torch.cat([wa, wb]), x, 256)
    assert np.all(np.abs(y[:, :13] - exact) <= 1e-6 * scale)
    torch.testing.assert_close(torch.from_numpy(y[:, 13:]), x @ wc.T, rtol=1e-5, atol=1e-4)


def test_rows_claimed_in_chunks_across_parts(lib, monkeypatch):
    """Threads claim weight rows in chunks of CLAIM_BYTES (64 KB: 113 rows of this Q4_K), so
    450 rows take 4 chunks that straddle the parts and the row map; every row's result is
    the same whichever thread claimed it, call after call."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    rng = np.random.default_rng(13)
    k = 1024
    shapes = ((Q.Q4_K, 200), (Q.Q6_K, 150), (Q.Q4_0, 100))
    a, b, c = (random_tensor(t, n, k, rng) for t, n in shapes)
    rowmap = torch.from_numpy(rng.permutation(200))
    parts = [QuantTensor(a, int(Q.Q4_K), 200, k, "a", rowmap)]
    parts += [QuantTensor(b, int(Q.Q6_K), 150, k), QuantTensor(c, int(Q.Q4_0), 100, k)]
    linear = QuantLinear(lib, parts)
    wa = reference(a, Q.Q4_K, 200, k)[rowmap]
    wb, wc = reference(b, Q.Q6_K, 150, k), reference(c, Q.Q4_0, 100, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    y = linear(x)
    exact, scale = int8_reference(torch.cat([wa, wb]), x, 256)
    assert np.all(np.abs(y[:, :350].numpy() - exact) <= 1e-6 * scale)
    torch.testing.assert_close(y[:, 350:], x @ wc.T, rtol=1e-5, atol=1e-4)
    for _ in range(20):
        assert torch.equal(linear(x), y)


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


def amx_lib(lib):
    if not hasattr(lib, "pd_quant_linear_amx"):
        pytest.skip(f"the {lib.isa} kernels have no AMX tiles")
    return lib


def bf16_bound(w: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """max |y_amx - y_fp32| per output: x and w each rounded to bf16 (2^-8 of the value at
    most: bf16 keeps 8 significant bits), exact products, fp32 sums: |x w| (2^-7 + 2^-16) per
    product."""
    product = np.abs(x.numpy().astype(np.float64)) @ np.abs(w.numpy().astype(np.float64)).T
    return product * (2.0**-7 + 2.0**-16)


@pytest.mark.parametrize("qtype", [t for t in TYPES if BLOCKS[t][0] > 1], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [QUANT_GEMV_M_MAX + 1, 33, 70])
def test_amx_tiles_within_the_int8_bound(lib, qtype, m):
    """Above QUANT_GEMV_M_MAX rows every block type takes AMX bf16 tiles (csrc/quant_amx.c):
    within bf16's bound of the fp32 matmul, which is inside the int8 activations' bound (per
    32 values, the tighter of the two int8 blocks); odd row and column counts."""
    lib = amx_lib(lib)
    rng = np.random.default_rng(int(qtype) * 1000 + m)
    rows, cols = 37, 768
    data = random_tensor(qtype, rows, cols, rng)
    w = reference(data, qtype, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    linear = QuantLinear(lib, [QuantTensor(data, int(qtype), rows, cols, "w")])
    assert linear.amx_tiles
    err = np.abs(linear(x).numpy() - (x @ w.T).numpy())
    _, scale = int8_reference(w, x, 32)  # fp32 sums: measured 3e-8 of the scale
    assert np.all(err <= bf16_bound(w, x) + 1e-6 * scale)
    assert np.all(bf16_bound(w, x) <= rounding_bound(w, x, 32))
    assert np.all(err <= rounding_bound(w, x, 32) + 1e-6 * scale)
    assert err.max() > 0  # bf16 did round


@pytest.mark.parametrize("qtype", [t for t in TYPES if BLOCKS[t][0] > 1], ids=lambda q: q.name)
def test_rows_decoded_to_bf16_equal_the_fp32_rows_rounded(lib, qtype):
    """The tiles' panels take Q4_0, Q4_1, Q8_0, Q4_K and Q6_K rows straight to bf16
    (pd_quant_row_bf16): bit for bit the fp32 rows rounded to nearest even; the other block
    types have no such decoder and go through fp32."""
    lib = amx_lib(lib)
    rows, cols = 3, 512
    data = random_tensor(qtype, rows, cols, np.random.default_rng(int(qtype) + 9))
    fp32 = QuantTensor(data, int(qtype), rows, cols, "w").dequantize_rows(lib, 0, rows)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    rcs = [
        lib.pd_quant_row_bf16(int(qtype), data[r].ctypes.data, out[r].data_ptr(), cols)
        for r in range(rows)
    ]
    decoded = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K}
    assert rcs == [0 if qtype in decoded else -1] * rows
    assert lib.pd_quant_row_bf16(int(qtype), data.ctypes.data, out.data_ptr(), cols + 1) == -1
    if qtype in decoded:
        expected = fp32.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(out.view(torch.int16), expected)


@pytest.mark.parametrize("qtype", list(INT8), ids=lambda q: q.name)
def test_a_row_differs_across_the_16_row_threshold_within_the_bounds(lib, qtype):
    """The same rows through the int8 kernel (16 rows) and AMX tiles (41): each is within
    its bound of the fp32 matmul, so they differ by at most the two bounds together."""
    lib = amx_lib(lib)
    rng = np.random.default_rng(int(qtype) + 5)
    data = random_tensor(qtype, 29, 512, rng)
    w = reference(data, qtype, 29, 512)
    linear = QuantLinear(lib, [QuantTensor(data, int(qtype), 29, 512, "w")])
    x = torch.randn(41, 512, generator=torch.Generator().manual_seed(41)) * 2
    small, large = linear(x[:QUANT_GEMV_M_MAX]), linear(x)[:QUANT_GEMV_M_MAX]
    x16 = x[:QUANT_GEMV_M_MAX]
    _, scale = int8_reference(w, x16, INT8[qtype])
    bound = rounding_bound(w, x16, INT8[qtype]) + bf16_bound(w, x16) + 2e-6 * scale
    assert np.all(np.abs((small - large).numpy()) <= bound)


def test_amx_fused_parts_row_map_and_bias(lib):
    """A fused Q4_K (row map) | Q6_K | Q4_0 linear on AMX tiles with a bias; an F32 part
    sends the whole linear to the fp32 path."""
    lib = amx_lib(lib)
    rng = np.random.default_rng(17)
    k, m = 512, 45
    shapes = ((Q.Q4_K, 40), (Q.Q6_K, 5), (Q.Q4_0, 3))
    a, b, c = (random_tensor(t, n, k, rng) for t, n in shapes)
    rowmap = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    parts = [QuantTensor(a, int(Q.Q4_K), 40, k, "a", rowmap)]
    parts += [QuantTensor(b, int(Q.Q6_K), 5, k), QuantTensor(c, int(Q.Q4_0), 3, k)]
    bias = torch.randn(48)
    linear = QuantLinear(lib, parts, bias)
    assert linear.amx_tiles
    w = torch.cat(
        [
            reference(a, Q.Q4_K, 40, k)[rowmap],
            reference(b, Q.Q6_K, 5, k),
            reference(c, Q.Q4_0, 3, k),
        ]
    )
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    _, scale = int8_reference(w, x, 32)
    err = np.abs((linear(x) - bias).numpy() - (x @ w.T).numpy())
    assert np.all(err <= bf16_bound(w, x) + 1e-6 * scale)
    f32 = random_tensor(Q.F32, 6, k, rng)
    mixed = QuantLinear(lib, [*parts, QuantTensor(f32, int(Q.F32), 6, k)])
    assert not mixed.amx_tiles
    wf = torch.cat([w, reference(f32, Q.F32, 6, k)])
    torch.testing.assert_close(mixed(x), x @ wf.T, rtol=1e-5, atol=1e-4 * wf.abs().max())


@pytest.mark.parametrize("qtype", list(INT8), ids=lambda q: q.name)
def test_int8_many_rows_without_amx(lib, qtype):
    """Without AMX tiles, 17 to INT8_MANY_M_MAX rows of an int8 type take int8 activations:
    each row as it is alone (64 at a time); above that, the fp32 GEMM path. Where Q4_K rows
    are packed eight at a time (the AVX2 kernels), every row count above 16 takes those
    tiles: the same integers, each row the same in any such call, also where a long call is
    split into blocks of rows."""
    if hasattr(lib, "pd_quant_linear_amx"):
        pytest.skip("the amx kernels take AMX tiles above 16 rows")
    rng = np.random.default_rng(int(qtype) + 9)
    data = random_tensor(qtype, 23, 512, rng)
    w = reference(data, qtype, 23, 512)
    linear = QuantLinear(lib, [QuantTensor(data, int(qtype), 23, 512, "w")])
    assert linear.int8_many_rows
    m = quant_linear.INT8_MANY_M_MAX
    x = torch.randn(m + 1, 512, generator=torch.Generator().manual_seed(8)) * 2
    many = linear(x[:m])
    exact, scale = int8_reference(w, x[:m], INT8[qtype])
    assert np.all(np.abs(many.numpy() - exact) <= 1e-6 * scale)
    if linear.int8_tiles:
        assert torch.equal(linear(x[:17]), many[:17])
        assert torch.equal(linear(x)[:m], many)  # past INT8_MANY_M_MAX: still the tiles
        big = linear(torch.cat([x] * 9)[:-7])  # 578 rows: blocks of 192-193 (TILE_M_BLOCK)
        for copy in big.split(m + 1)[:-1]:
            assert torch.equal(copy[:m], many)
        return
    alone = torch.cat([linear(x[i : i + 1]) for i in (0, 17, 63, m - 1)])
    assert torch.equal(many[[0, 17, 63, m - 1]], alone)
    torch.testing.assert_close(linear(x), x @ w.T, rtol=1e-5, atol=1e-4 * w.abs().max())


@pytest.mark.parametrize("m", [17, 23, 64])
def test_k_quant_tiles_across_parts_row_maps_and_tail_rows(lib, m):
    """Eight Q4_K or Q6_K rows packed together take every input row at once, two such groups
    sharing each broadcast of the input (the AVX2 kernels): in a fused Q4_K (row map) | Q6_K |
    Q4_K linear of 21 + 29 + 16 rows, rows 0-15 (Q4_K) and 32-47 (Q6_K) take two groups, 24-31
    (Q6_K) and 56-63 (Q4_K) one, rows that straddle parts or end one the one-row kernel; all
    within fp32 rounding of the integer algorithm, call after call."""
    if not lib.pd_q8_tile_type(int(Q.Q4_K), 256):
        pytest.skip(f"the {lib.isa} kernels pack no rows eight at a time")
    assert lib.pd_q8_tile_type(int(Q.Q6_K), 256) == 2
    rng = np.random.default_rng(m)
    k = 768
    shapes = ((Q.Q4_K, 21), (Q.Q6_K, 29), (Q.Q4_K, 16))
    a, b, c = (random_tensor(t, n, k, rng) for t, n in shapes)
    rowmap = torch.from_numpy(rng.permutation(21))
    parts = [QuantTensor(a, int(Q.Q4_K), 21, k, "a", rowmap), QuantTensor(b, int(Q.Q6_K), 29, k)]
    parts.append(QuantTensor(c, int(Q.Q4_K), 16, k, "c"))
    linear = QuantLinear(lib, parts)
    assert linear.int8_tiles
    w = torch.cat(
        [
            reference(a, Q.Q4_K, 21, k)[rowmap],
            reference(b, Q.Q6_K, 29, k),
            reference(c, Q.Q4_K, 16, k),
        ]
    )
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    y = linear(x)
    exact, scale = int8_reference(w, x, 256)
    assert np.all(np.abs(y.numpy() - exact) <= 1e-6 * scale)
    for _ in range(5):
        assert torch.equal(linear(x), y)


@pytest.mark.parametrize("m", [17, 23, 64])
def test_q8_0_tiles_split_each_byte_in_two_nibbles(lib, m):
    """Eight Q8_0 rows packed together (the AVX2 kernels) hold each weight plus 128 as two
    nibbles, 16 hi + lo - 128 sum(x) being the signed product's exact integer: in a fused
    Q8_0 (row map) | Q8_0 linear of 21 + 13 rows over 96 columns (no multiple of 256), rows
    0-15 and 24-31 take the tiles, the rest the one-row kernel; within fp32 rounding of the
    integer algorithm, with weights at both ends of int8's range."""
    if not lib.pd_q8_tile_type(int(Q.Q8_0), 96):
        pytest.skip(f"the {lib.isa} kernels pack no Q8_0 rows eight at a time")
    assert lib.pd_q8_tile_type(int(Q.Q8_0), 96) == 1
    rng = np.random.default_rng(m)
    k = 96
    a, b = random_tensor(Q.Q8_0, 21, k, rng), random_tensor(Q.Q8_0, 13, k, rng)
    a.reshape(-1, 34)[:, 2:4] = np.array([-128, 127], np.int8).view(np.uint8)  # int8's ends
    rowmap = torch.from_numpy(rng.permutation(21))
    parts = [QuantTensor(a, int(Q.Q8_0), 21, k, "a", rowmap), QuantTensor(b, int(Q.Q8_0), 13, k)]
    linear = QuantLinear(lib, parts)
    assert linear.int8_tiles
    w = torch.cat([reference(a, Q.Q8_0, 21, k)[rowmap], reference(b, Q.Q8_0, 13, k)])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    y = linear(x)
    exact, scale = int8_reference(w, x, 32)
    assert np.all(np.abs(y.numpy() - exact) <= 1e-6 * scale)
    assert torch.equal(linear(x), y)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.BF16, Q.Q4_K], ids=lambda q: q.name)
def test_amx_tiles_take_rows_past_the_row_kernel_of_types_without_int8(lib, qtype):
    """On the amx kernels a linear without an integer dot product leaves its fp32 row kernel,
    whose cost grows with every row, above AMX_FLOAT_GEMV_M_MAX rows (Q4_K keeps int8 up to
    QUANT_GEMV_M_MAX); the one-call decode step's weight says the same, and the tiles' result
    stays within bf16's rounding of the reference."""
    rng = np.random.default_rng(7)
    rows, cols = 40, 512
    data = random_tensor(qtype, rows, cols, rng)
    linear = QuantLinear(lib, [QuantTensor(data, int(qtype), rows, cols, "w")])
    on_tiles = lib.isa == "amx" and qtype != Q.Q4_K
    expected = quant_linear.AMX_FLOAT_GEMV_M_MAX if on_tiles else QUANT_GEMV_M_MAX
    assert linear.gemv_m_max == expected
    linear.as_c()
    assert linear._linear_c.gemv_m_max == expected
    if on_tiles:
        m = quant_linear.AMX_FLOAT_GEMV_M_MAX + 1
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(1))
        w = reference(data, qtype, rows, cols)
        bound = (2.0**-7 + 2.0**-15) * (x.abs() @ w.abs().T)  # x and w round to bf16
        assert ((linear(x) - x @ w.T).abs() <= bound + 1e-5).all()
