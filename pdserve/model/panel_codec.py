"""Lossless compact storage for panel-packed weights (`native.pack_panels`).

A decode step reads every weight once, so at small batches its GEMMs are bound by the bytes
they stream. Weights that came from a GGUF file sit on a grid: each run of 32 consecutive
inputs of one output row is `d * q + m` with q a 4-bit integer (Q4_1) or `d * q` with q an
int8 (Q8_0), d and m fp16 values — the fp32 weights the loader produced are exactly those
products. `encode` finds that grid and stores q plus (d, m) per block, 0.75 or 1.125 bytes
per weight instead of 4; the native GEMM expands a panel at a time back to fp32 in cache.
Because d is an fp16 value, `d * q` is exact in fp32, so the expanded weights are
bit-identical to the fp32 ones and every result is unchanged. A matrix is stored compactly
only if *every* weight round-trips bitwise; anything else (HF checkpoints, trained or
random weights) keeps the fp32 panels. Block layouts are described in csrc/gemm.c.
"""

from __future__ import annotations

import torch

QBLOCK = 32  # consecutive inputs sharing one (d, m)
F32, Q4A, Q8S = 0, 1, 2
CODEC_NAMES = {F32: "fp32", Q4A: "q4 affine", Q8S: "q8 symmetric"}


def _fp16_steps(x: torch.Tensor) -> list[torch.Tensor]:
    """x rounded to fp16, and its two fp16 neighbours: the candidates for a block's d."""
    h = x.half()
    up = torch.nextafter(h.float(), torch.full_like(x, float("inf"))).half()
    down = torch.nextafter(h.float(), torch.zeros_like(x)).half()
    return [h.float(), up.float(), down.float()]


def _pick(blocks: torch.Tensor, estimates, fit) -> tuple | None:
    """For blocks [B, 32], per block the first fp16 step d whose grid reproduces it exactly,
    as (q [B, 32], d [B, 1]); None if some block has none. estimates(blocks) lists [B, 1]
    guesses of the step, each tried rounded to fp16 and then as its two fp16 neighbours;
    fit(blocks, d) returns (q, reconstruction). Nearly every block fits the first guess, so
    the rest are tried only on the blocks that did not."""
    d = estimates(blocks)[0].half().float()
    q, rebuilt = fit(blocks, d)
    todo = torch.nonzero(~(rebuilt == blocks).all(-1)).flatten()
    if len(todo) == 0:
        return q, d
    sub = blocks[todo]
    candidates = [c for e in estimates(sub) for c in _fp16_steps(e)][1:]
    for i, cand in enumerate(candidates):
        q_c, rebuilt = fit(sub, cand)
        ok = (rebuilt == sub).all(-1)
        q[todo[ok]], d[todo[ok]] = q_c[ok], cand[ok]
        todo, sub = todo[~ok], sub[~ok]
        if len(todo) == 0:
            return q, d
        candidates[i + 1 :] = [c[~ok] for c in candidates[i + 1 :]]
    return None


def _sample_fits(weight: torch.Tensor, grid) -> bool:
    """A cheap first look on a few rows, so a matrix off the grid costs little to reject."""
    return weight.shape[0] <= 64 or grid(weight[:: max(1, weight.shape[0] // 16)][:16]) is not None


def q4_affine_grid(weight: torch.Tensor):
    """(q uint8 [N, K], d [N, K/32], m [N, K/32]) with weight == d * q + m exactly, or None."""
    n, k = weight.shape
    blocks = weight.reshape(-1, QBLOCK)
    m = blocks.amin(-1, keepdim=True)

    def estimates(sub):
        return [(sub.amax(-1, keepdim=True) - sub.amin(-1, keepdim=True)) / 15]

    def fit(sub, d):
        lo = sub.amin(-1, keepdim=True)
        q = torch.where(d > 0, ((sub - lo) / torch.where(d > 0, d, 1.0)).round(), 0.0)
        q = q.clamp_(0, 15)
        return q, torch.addcmul(lo, q, d)

    picked = _pick(blocks, estimates, fit)
    if picked is None:
        return None
    q, d = picked
    return q.to(torch.uint8).reshape(n, k), d.reshape(n, -1), m.reshape(n, -1)


def q8_symmetric_grid(weight: torch.Tensor):
    """(q int8 [N, K], d [N, K/32]) with weight == d * q exactly, or None."""
    n, k = weight.shape
    blocks = weight.reshape(-1, QBLOCK)

    def estimates(sub):  # 127 steps each side (Q8_0), or 8 (Q4_0's d * (q - 8))
        amax = sub.abs().amax(-1, keepdim=True)
        return [amax / 127, amax / 8]

    def fit(sub, d):
        q = torch.where(d > 0, (sub / torch.where(d > 0, d, 1.0)).round(), 0.0)
        q = q.clamp_(-127, 127)
        return q, q * d

    picked = _pick(blocks, estimates, fit)
    if picked is None:
        return None
    q, d = picked
    return q.to(torch.int8).reshape(n, k), d.reshape(n, -1)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _block_floats(v: torch.Tensor, panels: int, panel: int) -> torch.Tensor:
    """[Np, K/32] per-row block values -> [P, K/32, 4 panel] bytes: each block's floats."""
    return v.float().reshape(panels, panel, -1).transpose(1, 2).contiguous().view(torch.uint8)


def _q4_column_order(panel: int) -> torch.Tensor:
    """Which column each 4-bit slot of a panel row holds: slot 8g+j is nibble j of word g.
    In panels a multiple of 16 wide (AVX-512's 48) the two words of each 16 columns take
    them in turn (word 2h: columns 16h + 2j, word 2h+1: 16h + 2j + 1), so one 64-bit load
    broadcast to 16 lanes and shifted by 4 * (lane / 2) gives the 16 columns in order."""
    order = torch.arange(panel)
    if panel % 16:
        return order
    return order.reshape(-1, 8, 2).transpose(1, 2).reshape(panel)


def _encode_q4(q, d, m, panels: int, panel: int) -> torch.Tensor:
    kb = q.shape[1] // QBLOCK
    q = q.reshape(panels, panel, -1)[:, _q4_column_order(panel)].reshape(panels * panel, -1)
    # [P, panel, kb, 32] -> [P, kb, 32 (k), panel/8 (g), 8 (j)]: word g of row k packs
    # columns 8g+j, little-endian, so its byte b holds columns 8g+2b (low nibble) and
    # 8g+2b+1 (high)
    nib = q.reshape(panels, panel // 8, 8, kb, QBLOCK).permute(0, 3, 4, 1, 2)
    word_bytes = nib[..., 0::2] | (nib[..., 1::2] << 4)  # [P, kb, 32, panel/8, 4] uint8
    parts = [
        _block_floats(d, panels, panel),
        _block_floats(m, panels, panel),
        word_bytes.reshape(panels, kb, -1),
    ]
    return torch.cat(parts, -1).reshape(panels, -1).contiguous()


def _encode_q8(q, d, panels: int, panel: int) -> torch.Tensor:
    kb = q.shape[1] // QBLOCK
    qs = q.reshape(panels, panel, kb, QBLOCK).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    parts = [_block_floats(d, panels, panel), qs.reshape(panels, kb, -1)]
    return torch.cat(parts, -1).reshape(panels, -1).contiguous()


def encode(weight: torch.Tensor, panel: int, compact: bool = True) -> tuple[int, torch.Tensor]:
    """(codec, data of `panel`-column panels) for an fp32 [N, K] weight: the smallest
    lossless format. `panel` is the kernel variant's width, a multiple of 8."""
    weight = weight.detach().float().cpu()
    n, k = weight.shape
    panels = -(-n // panel)
    if compact and k % QBLOCK == 0:
        rows = panels * panel
        if _sample_fits(weight, q4_affine_grid) and (g := q4_affine_grid(weight)) is not None:
            q, d, m = (_pad_rows(t, rows) for t in g)
            return Q4A, _encode_q4(q, d, m, panels, panel)
        if _sample_fits(weight, q8_symmetric_grid) and (g := q8_symmetric_grid(weight)) is not None:
            q, d = (_pad_rows(t, rows) for t in g)
            return Q8S, _encode_q8(q, d, panels, panel)
    padded = _pad_rows(weight, panels * panel)
    return F32, padded.view(panels, panel, k).transpose(1, 2).contiguous()
