"""The Llama decoder layer on the native CPU kernels — a transform applied after loading.

At batch 1 a decode step is ~60 small PyTorch ops per layer (RMSNorm alone is seven), and on
a CPU each costs microseconds of dispatch while its arithmetic costs nanoseconds: the step is
bound by dispatch, not by the hardware. `FusedDecoderLayer` runs the same math as
`llama.DecoderLayer` in about ten calls: norm, QKV GEMM, RoPE + K/V store, attention, output
GEMM, residual add + norm, gate/up GEMM, SiLU·mul, down GEMM, residual add. It shares the
parameters of the layer it replaces and is only used where every kernel applies: fp32 on
the CPU with full-precision KV (an FP8 cache keeps the PyTorch layer, which quantizes on
write). tests/model/test_cpu_fused.py holds it equal to the reference layer.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import nn

from pdserve.model import native
from pdserve.model.attention import AttentionMetadata, attend
from pdserve.model.kv_cache import LayerCache
from pdserve.model.llama import DecoderLayer


class FusedDecoderLayer(nn.Module):
    def __init__(self, layer: DecoderLayer, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib = lib
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)  # fmt: skip
        # A decode-only step runs the whole layer in one C call when every linear has its
        # panel weights (not on prefill workers) and only QKV has a bias, as in Llama.
        self.one_call = all(getattr(m, "panel_weight", None) is not None for m in linears) and all(
            m.bias is None for m in linears[1:]
        )
        if self.one_call:  # the C side's pd_weight[4], built once (the tensors stay alive)
            self.weights = (native.PdWeight * 4)(*(m.panel_weight.as_c() for m in linears))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Updates the residual stream `x` [T, hidden] in place and returns it."""
        t = x.shape[0]
        if self.one_call and not meta.prefills and t <= native.PANEL_M_MAX:
            return self._decode_step(x, cos, sin, cache, meta)
        lib, attn, mlp = self.lib, self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(native.rmsnorm(lib, x, norm1.weight, norm1.eps))
        native.rope_qkv_store(
            lib, qkv, cos, sin, cache.blocks, meta.slot_block_ids, meta.slot_offsets, h
        )
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        o = attn.o_proj(attend(q, k, v, cache, meta).view(t, h * d))
        y = native.add_rmsnorm(lib, x, o, norm2.weight, norm2.eps)
        return x.add_(mlp.down_proj(native.silu_mul(lib, mlp.gate_up_proj(y))))

    def _decode_step(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The same layer for a step of one-token decodes only, in one native call."""
        attn, mlp = self.self_attn, self.mlp
        m, hidden = x.shape
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        inter = mlp.down_proj.in_features
        scratch = _scratch(self.lib.pd_decode_layer_scratch(m, hidden, h, kvh, d, inter))
        tables, lens, scores = (
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_scores,
        )
        qkv_bias = attn.qkv_proj.bias
        rc = self.lib.pd_decode_layer(
            x.data_ptr(), scratch.data_ptr(), m,
            self.input_layernorm.weight.data_ptr(), ctypes.addressof(self.weights),
            qkv_bias.data_ptr() if qkv_bias is not None else None,
            self.post_attention_layernorm.weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cache.blocks.data_ptr(),
            meta.slot_block_ids.data_ptr(), meta.slot_offsets.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), scores.data_ptr() if scores is not None else None,
            tables.shape[1], hidden, h, kvh, d, inter, cache.block_size,
            self.input_layernorm.eps,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("a decode-layer kernel could not allocate its scratch buffer")
        return x


_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """The decode layers' intermediates buffer: one per thread (engines in one process may
    step in different threads), grown as batches grow, reused by every layer and step
    instead of a fresh ~1 MB allocation per layer."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _local.buf = torch.empty(numel)
    return buf


def can_fuse(model: nn.Module, kv_cache: torch.Tensor) -> bool:
    """fp32 weights and a full-precision fp32 KV cache, both on the CPU."""
    p = next(model.parameters())
    return (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and kv_cache.device.type == "cpu"
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
    )


def fuse_layers(model: nn.Module, lib: ctypes.CDLL) -> int:
    """Replace each decoder layer of `model` by a `FusedDecoderLayer`; returns how many."""
    layers = model.layers
    for i, layer in enumerate(layers):
        layers[i] = FusedDecoderLayer(layer, lib)
    return len(layers)
