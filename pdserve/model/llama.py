"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU), plain PyTorch: Llama, Mistral, Qwen2/3
and Phi-3 are this one model with config switches (Q/K/V bias, Qwen3's Q/K norm; config.py).

It reads like the paper and knows nothing of serving: it takes a flat batch of tokens with
their positions and per-step attention metadata, and the KV cache tensor of each layer. The
Q/K/V and gate/up projections are fused into one matmul each (loader.py fuses the
checkpoint's separate weights) because on CPU one large GEMM beats three small ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import LayerCache
from pdserve.model.rope import apply_rope, cos_sin_table


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: each Q and K head RMS-normalized over head_dim, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, cache, meta)
        return self.o_proj(o.view(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerStack(nn.ModuleList):
    """The decoder layers, run in order. A backend may swap in a stack that runs some steps
    in fewer calls (cpu_fused.FusedLayerStack); the parameters' names stay `layers.{i}.*`."""

    def forward(self, x, cos, sin, caches, meta, on_layer_done=None):
        for i, layer in enumerate(self):
            x = layer(x, cos, sin, caches[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # The loaders build this on the meta device and put the checkpoint's weights in: no
        # initializer (nn.Embedding's normal_ on meta imports torch._dynamo: ~2 s a worker).
        empty = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty)
        self.layers = LayerStack(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        shape = (cfg.max_position_embeddings, cfg.head_dim)
        if torch.empty(0).is_meta:  # a loader's skeleton: it computes the tables on the CPU
            cos, sin = torch.empty(shape), torch.empty(shape)  # (arange on meta: ~2 s)
        else:
            cos, sin = cos_sin_table(
                cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
            )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Matrices a loader widened to fp32 as a fallback (the in-place kernels could not read
        # them): name -> reason, counted in the worker's Stats (`weights_widened`).
        self.widened_weights: dict[str, str] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LayerCache],
        meta: AttentionMetadata,
        on_layer_done=None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]. `caches[i]` holds
        layer i's KV blocks. `on_layer_done(i)` is called once layer i's KV is in the cache:
        layer-wise KV transfer hooks in here."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        return self.norm(self.layers(x, cos, sin, caches, meta, on_layer_done))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def keep_rope_positions(self, num_positions: int) -> None:
        """Keep the rope tables' first `num_positions` rows (the engine's max_model_len: no
        position reaches it), freeing the rest: a table for the whole context of a Llama 3
        checkpoint (131072 positions, head_dim 128) is 128 MiB a worker."""
        if num_positions < self.rope_cos.shape[0]:
            self.rope_cos = self.rope_cos[:num_positions].clone()
            self.rope_sin = self.rope_sin[:num_positions].clone()
