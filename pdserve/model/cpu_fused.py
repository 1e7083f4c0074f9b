"""The Llama decoder layers on the native CPU kernels — a transform applied after loading.

At batch 1 a decode step is ~60 small PyTorch ops per layer (RMSNorm alone is seven), and on
a CPU each costs microseconds of dispatch while its arithmetic costs nanoseconds: the step is
bound by dispatch, not by the hardware. `FusedDecoderLayer` runs the same math as
`llama.DecoderLayer` in about ten calls: norm, QKV GEMM, RoPE + K/V store, attention, output
GEMM, residual add + norm, gate/up GEMM, SiLU·mul, down GEMM, residual add. It shares the
parameters of the layer it replaces and is only used where every kernel applies: fp32 on
the CPU with full-precision KV (an 8-bit cache keeps the PyTorch layer, which quantizes on
write). A step of decodes only goes further: `FusedLayerStack` runs all layers in one
native call (at batch 32, a ctypes call and its argument building per layer cost ~5% of
the step), on panel weights or GGUF weights read in place (`QuantLinear`, each linear on the
kernel its `forward` takes for that many rows, up to `native_m_max`).
tests/model/test_cpu_fused.py holds both equal to the reference layers.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import nn

from pdserve.model import native, quant_linear
from pdserve.model.attention import AttentionMetadata, attend
from pdserve.model.kv_cache import LayerCache
from pdserve.model.llama import DecoderLayer, LayerStack
from pdserve.model.quant_linear import QuantLinear


class FusedDecoderLayer(nn.Module):
    def __init__(self, layer: DecoderLayer, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib = lib
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp

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
        lib, attn, mlp = self.lib, self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(native.rmsnorm(lib, x, norm1.weight, norm1.eps))
        if attn.q_norm is not None:  # Qwen3: per-head Q/K norms, in place, before RoPE
            q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            q.copy_(attn.q_norm(q))
            k.copy_(attn.k_norm(k))
        native.rope_qkv_store(
            lib, qkv, cos, sin, cache.blocks, meta.slot_block_ids, meta.slot_offsets, h
        )
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        o = attn.o_proj(attend(q, k, v, cache, meta).view(t, h * d))
        y = native.add_rmsnorm(lib, x, o, norm2.weight, norm2.eps)
        return x.add_(mlp.down_proj(native.silu_mul(lib, mlp.gate_up_proj(y))))


class FusedLayerStack(LayerStack):
    """The fused layers, and the decode-only step as one native call over all of them."""

    def __init__(self, layers: LayerStack, lib: ctypes.CDLL) -> None:
        super().__init__(FusedDecoderLayer(layer, lib) for layer in layers)
        self.lib = lib
        # Decode-only steps take the one call when every linear has its panel weights (not
        # on prefill workers) or is read in place from a GGUF, only QKV has a bias (as in
        # Llama) and the norms (Qwen3's per-head Q/K norms included) share an eps.
        norms = (n for layer in self for n in _norms(layer) if n is not None)
        linears = [m for layer in self for m in _linears(layer)]
        self.one_call = len({n.eps for n in norms}) == 1 and all(
            _native_weight(m) is not None and (m.bias is None or i % 4 == 0)
            for i, m in enumerate(linears)
        )
        # Up to this many rows every linear's kernel runs in C: panels to PANEL_M_MAX, GGUF
        # weights to where QuantLinear.forward leaves them to PyTorch's GEMM.
        self.max_rows = min(
            (m.native_m_max if isinstance(m, QuantLinear) else native.PANEL_M_MAX for m in linears),
            default=native.PANEL_M_MAX,
        )
        self._layers_c = None  # the C side's pd_layer[L], built for one set of caches
        self._caches_key: tuple[int, ...] = ()

    def forward(self, x, cos, sin, caches, meta, on_layer_done=None):
        if not (self.one_call and not meta.prefills and x.shape[0] <= self.max_rows):
            return super().forward(x, cos, sin, caches, meta, on_layer_done)
        layers_c = self._layers_for(caches)
        first = self[0]
        attn, mlp = first.self_attn, first.mlp
        m, hidden = x.shape
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        inter = mlp.down_proj.in_features
        scratch = _scratch(self.lib.pd_decode_layer_scratch(m, hidden, h, kvh, d, inter))
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        scores = meta.decode_scores
        # With a hook between layers (layer-wise KV transfer), one call per layer.
        spans = [(0, len(self))] if on_layer_done is None else [(i, 1) for i in range(len(self))]
        for start, count in spans:
            rc = self.lib.pd_decode_layers(
                x.data_ptr(),
                scratch.data_ptr(),
                m,
                ctypes.addressof(layers_c) + start * ctypes.sizeof(native.PdLayer),
                count,
                cos.data_ptr(),
                sin.data_ptr(),
                meta.slot_block_ids.data_ptr(),
                meta.slot_offsets.data_ptr(),
                tables.data_ptr(),
                lens.data_ptr(),
                None if scores is None else scores.data_ptr(),
                tables.shape[1],
                hidden,
                h,
                kvh,
                d,
                inter,
                caches[0].block_size,
                first.input_layernorm.eps,
                quant_linear.int8_rows(m),
            )
            if rc != 0:
                raise MemoryError("a decode-layer kernel could not allocate its scratch buffer")
            if on_layer_done is not None:
                on_layer_done(start)
        return x

    def _layers_for(self, caches: list[LayerCache]):
        """pd_layer[L] for these caches (rebuilt only if a cache tensor moved; the
        parameters and panel weights stay where loading put them)."""
        key = tuple(c.blocks.data_ptr() for c in caches)
        if key != self._caches_key:
            layers_c = (native.PdLayer * len(self))()
            for c_layer, layer, cache in zip(layers_c, self, caches):
                bias = layer.self_attn.qkv_proj.bias
                c_layer.norm1 = layer.input_layernorm.weight.data_ptr()
                c_layer.norm2 = layer.post_attention_layernorm.weight.data_ptr()
                c_layer.qkv_bias = bias.data_ptr() if bias is not None else None
                for j, linear in enumerate(_linears(layer)):
                    c_layer.w[j] = _native_weight(linear)
                c_layer.cache = cache.blocks.data_ptr()
                if (q_norm := layer.self_attn.q_norm) is not None:
                    c_layer.q_norm = q_norm.weight.data_ptr()
                    c_layer.k_norm = layer.self_attn.k_norm.weight.data_ptr()
            self._layers_c, self._caches_key = layers_c, key
        return self._layers_c


def _native_weight(linear: nn.Module) -> native.PdWeight | None:
    """The linear's weight as `pd_decode_layers` reads it, or None where it has none."""
    if isinstance(linear, QuantLinear):
        return linear.as_c()
    panel = getattr(linear, "panel_weight", None)
    return None if panel is None else panel.as_c()


def _norms(layer: nn.Module) -> tuple[nn.Module | None, ...]:
    attn = layer.self_attn
    return (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """QKV, output, gate/up, down: the order of pd_layer.w."""
    return (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )


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
    tensors = (next(model.parameters()), kv_cache)
    fp32_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    return fp32_cpu and kv_cache.is_contiguous()


def fuse_layers(model: nn.Module, lib: ctypes.CDLL) -> int:
    """Replace `model`'s decoder layers by a `FusedLayerStack`; returns how many layers."""
    model.layers = FusedLayerStack(model.layers, lib)
    return len(model.layers)
