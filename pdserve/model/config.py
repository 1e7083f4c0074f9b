"""The model's shape, read from a Hugging Face `config.json`.

The families pdserve runs are one decoder (llama.py) with a few switches, so each is a config
here rather than a model class: Llama 2/3.x (rope scaling linear or llama3, tied or untied
embeddings), Mistral, Qwen2/2.5 (Q/K/V biases), Qwen3 (per-head RMSNorm on Q and K before
RoPE) and Phi-3 (fused qkv_proj/gate_up_proj, which is our layout already). Anything else is
refused by name. A sliding window shorter than the context caps the context at the window,
where sliding and full attention are the same computation (logged).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
# Q/K/V biases as each family's Hugging Face attention builds them: Qwen2 always has them,
# Mistral and Phi-3 never, Llama and Qwen3 as `attention_bias` says.
_QKV_BIAS = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False, "Phi3ForCausalLM": False}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each Q and K head, before RoPE
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"pdserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _check_rotary(hf, arch)
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            eos = hf.get("eos_token_id")
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
                rope_theta=_rope_theta(hf),
                rope_scaling=_rope_scaling(hf),
                max_position_embeddings=_context_len(hf, arch),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=_QKV_BIAS.get(arch, bool(hf.get("attention_bias"))),
                qk_norm=arch == "Qwen3ForCausalLM",
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos else []),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from None
        return cls.from_hf(hf)


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling, rope_type=kind)


def _check_rotary(hf: dict[str, Any], arch: str) -> None:
    """ValueError for rotary variants the rope tables do not compute, named."""
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"{arch}: partial rotary (partial_rotary_factor {partial}) is unsupported")
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3", "freq_factors"):
        raise ValueError(
            f"{arch}: rope scaling {kind!r} is unsupported (supported: linear, llama3; "
            "Phi-3's 128k variants use longrope)"
        )


def _context_len(hf: dict[str, Any], arch: str) -> int:
    """The model's context, capped at its sliding window when that is shorter: up to the
    window every key is in reach, so full attention computes what the window would."""
    context = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window")
    # Qwen2/3 configs carry a window they do not use unless use_sliding_window is set.
    uses_window = hf.get("use_sliding_window")
    if uses_window is None:
        uses_window = arch in ("MistralForCausalLM", "Phi3ForCausalLM")
    if window and uses_window and int(window) < context:
        log.warning(
            "%s: sliding_window %d < max_position_embeddings %d: context capped at %d tokens "
            "(pdserve attends in full; within the window that is the same attention)",
            arch,
            int(window),
            context,
            int(window),
        )
        return int(window)
    return context
