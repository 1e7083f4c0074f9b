"""The C kernels against their PyTorch references (skipped where they cannot be built)."""

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from pdserve import envs
from pdserve.model import native
from pdserve.model.cpu_linear import PackedLinear


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("n,k", [(96, 64), (7, 40), (33, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_panels_equals_f_linear(lib, m, n, k, bias):
    """Every micro-kernel height (1..8 rows), partial last panels, odd K."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = native.linear_panels(lib, x, native.pack_panels(lib, w), b)
    torch.testing.assert_close(y, F.linear(x, w, b))


def test_packed_linear_takes_either_path(lib):
    """Small inputs take the panel kernel, large ones oneDNN; a decode-only copy takes any."""
    linear = torch.nn.Linear(40, 24)
    both, panels_only = PackedLinear(linear, lib), PackedLinear(linear, lib, onednn=False)
    assert panels_only.packed_weight is None
    for m in (1, native.PANEL_M_MAX, native.PANEL_M_MAX + 1, 200):
        x = torch.randn(m, 40)
        want = linear(x).detach()
        torch.testing.assert_close(both(x), want)
        torch.testing.assert_close(panels_only(x), want)
    with pytest.raises(ValueError, match="needs"):
        PackedLinear(linear, None, onednn=False)


def reference_attention(q, blocks, tables, lens):
    """Dense attention over each sequence's gathered context (GQA by repeating K/V)."""
    b, heads, d = q.shape
    kv_heads, bs = blocks.shape[2], blocks.shape[3]
    out = torch.empty_like(q)
    probs_per_block = torch.zeros(tables.shape, dtype=torch.float32)
    for i in range(b):
        n = int(lens[i])
        ids = tables[i, : -(-n // bs)]
        k = blocks[ids, 0].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n]
        v = blocks[ids, 1].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n]
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        p = (q[i].unsqueeze(1) @ k.transpose(1, 2) * d**-0.5).softmax(-1)  # [heads, 1, n]
        out[i] = (p @ v).squeeze(1)
        per_token = F.pad(p.sum((0, 1)), (0, -n % bs))
        probs_per_block[i, : per_token.numel() // bs] = per_token.view(-1, bs).sum(-1)
    return out, probs_per_block


@pytest.mark.parametrize(
    "heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 2, 36), (8, 2, 64), (4, 2, 32), (3, 3, 32)]
)
@pytest.mark.parametrize("copies", [1, 8])
def test_paged_decode_attention_equals_dense(lib, heads, kv_heads, d, copies):
    """5 sequences take one work item per (sequence, KV head); 40 (copies=8) one per
    sequence, walking all its KV heads block by block."""
    g = torch.Generator().manual_seed(heads + d)
    num_blocks, bs = 40, 16
    blocks = torch.randn(num_blocks, 2, kv_heads, bs, d, generator=g)
    lens = torch.tensor([1, 16, 17, 150, 63] * copies)
    max_blocks = -(-int(lens.max()) // bs)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)  # 0-padded like decode_tables
    used = 0
    for i, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used = (used + nb) % (num_blocks - max_blocks)
    q = torch.randn(len(lens), heads, d, generator=g)
    scores = torch.zeros(tables.shape)
    out = native.paged_decode_attention(lib, q, blocks, tables, lens, scores)
    want, want_scores = reference_attention(q, blocks, tables, lens)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores, want_scores, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(native.paged_decode_attention(lib, q, blocks, tables, lens), out)


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_build_is_cached(tmp_path, isa):
    """Built once per variant (compiling needs no CPU support for it)."""
    first = native.build(isa, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build(isa, tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert isa in first.name


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_vnni_instructions_only_in_the_vnni_builds(isa):
    """The VNNI variants (and amx) take their int8 sums in vpdpbusd, the others never emit it
    (a variant whose flags lost VNNI would pass every equality test and be silently slower)."""
    disassembly = subprocess.run(
        ["objdump", "-d", str(native.build(isa))], capture_output=True, text=True
    ).stdout
    assert ("vpdpbusd" in disassembly) == (isa == "amx" or isa.endswith("vnni"))


def test_variant_choice(lib, monkeypatch):
    """auto takes the widest variant this CPU runs; a forced one is taken as named; a
    misspelt one is an error naming the variable."""
    widest = next(isa for isa in native.ISA_FLAGS if native.cpu_supports(isa))
    monkeypatch.setenv(envs.CPU_ISA, "auto")
    assert native.load().isa == widest
    monkeypatch.setenv(envs.CPU_ISA, lib.isa)
    widths = {"avx2": 24, "avx2vnni": 24, "avx512": 48, "avx512vnni": 48, "amx": 48}
    assert native.load() is lib and lib.panel_width == widths[lib.isa]
    monkeypatch.setenv(envs.CPU_ISA, "sse2")
    with pytest.raises(ValueError, match=envs.CPU_ISA):
        native.load()


# /proc/cpuinfo flags (the ones the variants read) of CPUs without AMX, by the variant `auto`
# gives them: AMD Zen 4 (AVX512_VNNI and AVX512_BF16), Intel Skylake-SP, Alder Lake, Zen 3.
_AVX2, _AVX512 = {"avx2", "fma", "f16c"}, {"avx2", "fma", *native.CPU_FLAGS["avx512"]}
CPU_WITHOUT_AMX = {
    "avx512vnni": {*_AVX512, "avx512_vnni", "avx512_bf16"},
    "avx512": _AVX512,
    "avx2vnni": {*_AVX2, "avx_vnni"},
    "avx2": _AVX2,
}


@pytest.mark.parametrize("isa", list(CPU_WITHOUT_AMX))
def test_auto_picks_the_variant_of_each_cpu(monkeypatch, isa):
    """auto on a CPU with the flags of one without AMX takes its widest variant: the VNNI build
    where the CPU has VNNI (here a subset of this CPU's flags, so the variant runs)."""
    flags = frozenset(CPU_WITHOUT_AMX[isa])
    if not flags <= native.cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(flags - native.cpu_flags())}")
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    assert native._load.__wrapped__("auto").isa == isa


def test_auto_falls_back_to_a_narrower_variant(monkeypatch):
    """A variant that fails to build is skipped for the next narrower one; with no variant
    the CPU runs, the kernels are off (None: callers keep the PyTorch paths)."""
    if not native.cpu_supports("avx2"):
        pytest.skip("this CPU runs no native kernel variant")
    real_build = native.build

    def build(isa, out_dir=None):
        if isa != "avx2":
            raise RuntimeError(f"{isa} build failed")
        return real_build(isa, out_dir)

    monkeypatch.setattr(native, "build", build)
    assert native._load.__wrapped__("auto").isa == "avx2"
    monkeypatch.setattr(native, "cpu_supports", lambda isa: False)
    assert native._load.__wrapped__("auto") is None


def test_weight_packed_for_another_variant_is_refused(lib):
    other = native.PanelWeight(torch.zeros(1), 0, 8, 8, panel=lib.panel_width * 2)
    with pytest.raises(ValueError, match="packed in"):
        native.linear_panels(lib, torch.zeros(1, 8), other, None)


def test_elementwise_kernels_equal_torch(lib):
    g = torch.Generator().manual_seed(7)
    x, add, w = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g), torch.randn(40)
    torch.testing.assert_close(native.rmsnorm(lib, x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5))
    residual = x.clone()
    y = native.add_rmsnorm(lib, residual, add, w, 1e-5)
    torch.testing.assert_close(residual, x + add)
    torch.testing.assert_close(y, F.rms_norm(x + add, (40,), w, 1e-5))
    gate_up = torch.randn(3, 2 * 37, generator=g) * 30  # large |x| too: exp saturates cleanly
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(lib, gate_up), F.silu(gate) * up)


def test_rope_qkv_store_equals_rope_then_write(lib):
    from pdserve.model.kv_cache import LayerCache
    from pdserve.model.rope import apply_rope, cos_sin_table

    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d, bs, t = 4, 2, 16, 4, 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = cos_sin_table(d, 10000.0, None, 64)
    positions = torch.tensor([0, 5, 9, 17, 33, 63])
    slots_b, slots_o = torch.tensor([3, 3, 1, 0, 2, 2]), torch.tensor([0, 1, 3, 2, 0, 3])
    blocks = torch.zeros(4, 2, kv_heads, bs, d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q = apply_rope(q.view(t, heads, d), cos[positions], sin[positions])
    want_k = apply_rope(k.reshape(t, kv_heads, d), cos[positions], sin[positions])
    want_blocks = torch.zeros_like(blocks)
    LayerCache(want_blocks).write(want_k, v.reshape(t, kv_heads, d), slots_b, slots_o)
    qkv_out = qkv.clone()
    native.rope_qkv_store(
        lib, qkv_out, cos[positions], sin[positions], blocks, slots_b, slots_o, heads
    )
    torch.testing.assert_close(qkv_out[:, : heads * d].view(t, heads, d), want_q)
    torch.testing.assert_close(blocks, want_blocks)


@pytest.mark.parametrize("n", [1, 7, 8, 49152 + 3])
def test_argmax_rows_equals_torch_argmax(lib, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    x[1] = x[1].round()  # ties: the first maximal index wins
    x[2, n // 2] = float("nan")  # a NaN wins over everything
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    x[5] = 0.0
    x[5, n - 1] = -0.0  # -0.0 == 0.0: still the first zero
    x[6, :: max(n // 3, 1)] = float("nan")  # the first NaN
    assert torch.equal(native.argmax_rows(lib, x), x.argmax(-1))
