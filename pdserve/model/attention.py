"""Attention over the paged KV cache — the only code that knows the paged layout.

Layout of one layer's cache (one tensor for all blocks; docs/ARCHITECTURE.md, "KV cache layout"):

    kv_layer[block_id, 0 | 1, kv_head, offset, :]      0 = K, 1 = V
    a token at position p of a request lives in block block_table[p // block_size],
    at offset p % block_size; its "slot" is that (block, offset) pair.

A block is contiguous (so a run of blocks is one transfer write), and within it each head's
[block_size, head_dim] tile is contiguous (so gathering a request's keys head by head is a
row copy that lands directly in the [kv_heads, batch, tokens, head_dim] layout attention
multiplies with — no second reshuffling copy).

A step's tokens are flattened into one batch, one-token decodes first, then prefill chunks.
Decodes are attended in one batched call over their gathered context; each prefill chunk is
attended on its own (few per step, each large). This is the plain-torch reference; a fused
kernel can replace `paged_attention` on CUDA as long as it matches it (tests/model).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.model import native
from pdserve.model.kv_cache import LayerCache


@dataclass
class PrefillSpan:
    """A prefill chunk: batch rows [start, end) at positions [num_context, num_context+len)."""

    start: int
    end: int
    num_context: int  # tokens of this request whose KV was cached before this step
    block_ids: torch.Tensor  # [num_blocks] long, covers all num_context + (end - start) tokens
    scores: torch.Tensor | None = None  # [num_blocks]: attention the last queries paid each block


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention, built once by the model runner and shared by all
    layers (the model itself never sees requests)."""

    slot_block_ids: torch.Tensor  # [num_tokens] long: block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] long: offset in that block
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], 0-padded
    # [1, num_decodes, 1, max_blocks * block_size]; built by the first layer that needs it
    # (from decode_context_lens) when not given: the native kernels never do.
    decode_mask: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long
    # Token dropping: attention each decode paid each of its blocks, summed over layers/heads.
    decode_scores: torch.Tensor | None = None  # [num_decodes, max_blocks]
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The native CPU kernels (native.py) when the runner chose them: decode attention then
    # reads K/V in place from fp32 blocks instead of gathering a copy first.
    kernels: ctypes.CDLL | None = None


def decode_tables(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device,
    with_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block tables padded to the longest context (padding points at block 0), and (unless
    not `with_mask`) the key mask that hides padding and the unused tail of each last block."""
    max_blocks = -(-max(context_lens) // block_size)
    rows = []
    for blocks, n in zip(block_tables, context_lens):
        used = -(-n // block_size)
        rows.append(blocks[:used] + [0] * (max_blocks - used))
    table = torch.tensor(rows, dtype=torch.long)  # one tensor, not one per row (~0.3 ms at 32)
    if not with_mask:
        return table.to(device), None
    return table.to(device), key_mask(torch.tensor(context_lens), max_blocks * block_size, device)


def key_mask(context_lens: torch.Tensor, num_keys: int, device: torch.device) -> torch.Tensor:
    """[1, num_decodes, 1, num_keys]: True where a key lies within its request's context."""
    keys = torch.arange(num_keys, device=context_lens.device)
    mask = keys.unsqueeze(0) < context_lens.unsqueeze(1)
    return mask[None, :, None, :].to(device)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] for this step's tokens -> [T, heads, d].

    Stores the new K/V in the cache first, then attends each token to its request's context.
    """
    cache.write(k, v, meta.slot_block_ids, meta.slot_offsets)
    return attend(q, k, v, cache, meta)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata
) -> torch.Tensor:
    """`paged_attention` once this step's K/V are already in the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n and meta.kernels is not None and native.reads_in_place(cache, q):
        out[:n] = native.paged_decode_attention(
            meta.kernels,
            q[:n],
            cache.blocks,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_scores,
        )
    elif n:
        keys, values = cache.gather(meta.decode_block_tables, q.dtype)  # [kv_heads, n, L, d]
        if meta.decode_mask is None:  # the runner leaves it to the layers that need it
            meta.decode_mask = key_mask(meta.decode_context_lens, keys.shape[2], q.device)
        # Query heads that share a KV head go on the "query length" axis, and the KV head
        # is SDPA's batch axis: one call over [kv_heads, n, group, d], no repeated K/V.
        qg = q[:n].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        if meta.decode_scores is None:
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask)
        else:
            o = _attend_and_score(qg, keys, values, meta.decode_mask, meta.decode_scores)
        out[:n] = o.transpose(0, 1).reshape(n, num_heads, head_dim)
    for span in meta.prefills:
        rows = slice(span.start, span.end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], cache, span)
    return out


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, span: PrefillSpan
) -> torch.Tensor:
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    mask = None  # no cached context: causal within the chunk, straight from this step's K/V
    keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if span.num_context:
        total = span.num_context + q.shape[0]
        tables = span.block_ids[: -(-total // cache.block_size)].unsqueeze(0)
        keys, values = (t.transpose(0, 1) for t in cache.gather(tables, q.dtype))  # [1, kvh, L, d]
        key_pos = torch.arange(keys.shape[2], device=q.device)
        query_pos = torch.arange(span.num_context, total, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # causal with offset; hides the tail
    o = F.scaled_dot_product_attention(
        qt, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    if span.scores is not None:
        _score_window(qt, keys, span.num_context, span.scores, cache.block_size)
    return o.squeeze(0).transpose(0, 1)


SCORE_WINDOW = 32  # the prompt's last queries whose attention ranks its blocks (as SnapKV)


def _attend_and_score(q, keys, values, mask, scores: torch.Tensor) -> torch.Tensor:
    """Decode attention that also adds, per request and block, the attention probability
    its queries paid (token dropping ranks blocks by it). q [kv_heads, n, group, d]."""
    s = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = s.masked_fill(~mask, float("-inf")).softmax(-1)  # [kv_heads, n, group, L]
    n, num_blocks = scores.shape
    scores += probs.sum(dim=(0, 2)).view(n, num_blocks, -1).sum(-1)
    return torch.matmul(probs, values)


def _score_window(q, keys, first_pos: int, scores: torch.Tensor, block_size: int) -> None:
    """At the end of a prompt: the attention its last SCORE_WINDOW queries pay each block.
    q [1, heads, n, d] at positions first_pos..; keys [1, kv_heads, L, d] from position 0."""
    window = min(SCORE_WINDOW, q.shape[2])
    qw = q[0, :, -window:]  # [heads, w, d]
    k = keys[0].repeat_interleave(q.shape[1] // keys.shape[1], dim=0)  # [heads, L, d]
    s = torch.matmul(qw, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    query_pos = torch.arange(first_pos + q.shape[2] - window, first_pos + q.shape[2])
    key_pos = torch.arange(k.shape[1])
    s = s.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    per_token = s.softmax(-1).sum(dim=(0, 1))  # [L]
    pad = (-per_token.shape[0]) % block_size
    per_block = F.pad(per_token, (0, pad)).view(-1, block_size).sum(-1)
    scores[: per_block.shape[0]] += per_block
