"""Paged attention equals dense causal attention on the same inputs."""

import torch
import torch.nn.functional as F

from pdserve.model.attention import (
    AttentionMetadata,
    PrefillSpan,
    decode_tables,
    paged_attention,
)
from pdserve.model.kv_cache import LayerCache

H, KVH, D, BS, NB = 4, 2, 8, 4, 32


def dense(q, k, v):
    """Reference: [T, H, d] causal attention with K/V repeated per query group."""
    rep = H // KVH
    qt, kt, vt = (
        x.transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    )
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(0, 1)


def slots(block_ids, positions):
    return (
        torch.tensor([block_ids[p // BS] for p in positions]),
        torch.tensor([p % BS for p in positions]),
    )


def test_prefill_then_chunks_then_decodes_match_dense():
    torch.manual_seed(0)
    total = 23
    q, k, v = torch.randn(total, H, D), torch.randn(total, KVH, D), torch.randn(total, KVH, D)
    want = dense(q, k, v)
    kv = torch.zeros(NB, 2, KVH, BS, D)
    block_ids = [7, 3, 12, 0, 30, 5]  # deliberately scattered
    table = torch.tensor(block_ids)
    got = torch.empty_like(q)
    # A first chunk of 9 tokens, a second of 10 (attending to the cached first), then 4 decodes.
    for start, end in [(0, 9), (9, 19)]:
        sb, so = slots(block_ids, range(start, end))
        meta = AttentionMetadata(sb, so, prefills=[PrefillSpan(0, end - start, start, table)])
        got[start:end] = paged_attention(
            q[start:end], k[start:end], v[start:end], LayerCache(kv), meta
        )
    for pos in range(19, total):
        sb, so = slots(block_ids, [pos])
        table, mask = decode_tables([block_ids], [pos + 1], BS, torch.device("cpu"))
        meta = AttentionMetadata(sb, so, 1, table, mask)
        got[pos : pos + 1] = paged_attention(
            q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], LayerCache(kv), meta
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_decodes_of_different_lengths_and_a_prefill_in_one_step():
    torch.manual_seed(1)
    lens = [5, 17, 1]
    seqs = [(torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)) for n in lens]
    tables = [[1, 2], [3, 4, 8, 9, 10], [11]]
    kv = torch.zeros(NB, 2, KVH, BS, D)
    # Fill each sequence's context except its last token, as earlier steps would have.
    for (_, k, v), blocks, n in zip(seqs, tables, lens):
        if n > 1:
            sb, so = slots(blocks, range(n - 1))
            kv[sb, 0, :, so], kv[sb, 1, :, so] = k[: n - 1], v[: n - 1]
    # This step: the last token of seqs 0 and 1 decode; seq 2 (1 token) too; plus a new prefill.
    pq, pk, pv = torch.randn(6, H, D), torch.randn(6, KVH, D), torch.randn(6, KVH, D)
    q = torch.cat([s[0][-1:] for s in seqs] + [pq])
    k = torch.cat([s[1][-1:] for s in seqs] + [pk])
    v = torch.cat([s[2][-1:] for s in seqs] + [pv])
    sb, so = zip(*[slots(b, [n - 1]) for b, n in zip(tables, lens)])
    psb, pso = slots([20, 21], range(6))
    table, mask = decode_tables(tables, lens, BS, torch.device("cpu"))
    meta = AttentionMetadata(
        torch.cat([*sb, psb]),
        torch.cat([*so, pso]),
        3,
        table,
        mask,
        prefills=[PrefillSpan(3, 9, 0, torch.tensor([20, 21]))],
    )
    got = paged_attention(q, k, v, LayerCache(kv), meta)
    for i, (sq, sk, sv) in enumerate(seqs):
        torch.testing.assert_close(got[i], dense(sq, sk, sv)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3:], dense(pq, pk, pv), atol=1e-5, rtol=1e-5)


def test_decodes_without_a_mask_build_it_from_their_context_lens():
    """The runner gives no key mask (the native kernels need none); the PyTorch path then
    builds the one decode_tables would, so padded keys stay hidden."""
    torch.manual_seed(2)
    lens, tables = [3, 10], [[1], [2, 3, 4]]
    kv = torch.randn(NB, 2, KVH, BS, D)
    q = torch.randn(2, H, D)
    table, mask = decode_tables(tables, lens, BS, torch.device("cpu"))
    given = AttentionMetadata(torch.tensor([1, 4]), torch.tensor([2, 1]), 2, table, mask)
    want = paged_attention(q, q[:, :KVH], q[:, :KVH], LayerCache(kv.clone()), given)
    table, none = decode_tables(tables, lens, BS, torch.device("cpu"), with_mask=False)
    built = AttentionMetadata(
        torch.tensor([1, 4]), torch.tensor([2, 1]), 2, table, none, torch.tensor(lens)
    )
    got = paged_attention(q, q[:, :KVH], q[:, :KVH], LayerCache(kv.clone()), built)
    assert none is None
    assert torch.equal(built.decode_mask, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
