"""Convert a llama-architecture GGUF file into a Hugging Face model directory (fp32).

The engine loads one format (HF config + safetensors + tokenizer files), so GGUF support is a
one-time conversion rather than a second loader. Every tensor is dequantized with the `gguf`
package; names are mapped to HF Llama names; and llama.cpp's Q/K row permutation is undone,
because `convert_hf_to_gguf.py` reorders each head's rows from HF's rotate-half RoPE layout to
llama.cpp's interleaved-pair layout:

    HF head rows   [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]      (rotate_half pairs x_i, y_i)
    GGUF head rows [x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)]           (adjacent pairs)

The output is written into a temporary sibling directory and renamed into place at the end, so an
interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)
SOURCE_MARKER = "pdserve_source.json"
# Bump when the output format changes, so caches written by an older converter are redone.
CONVERTER_VERSION = 1

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into an HF-format directory at `out_dir` (replaced if present).

    Raises ValueError naming the file for a corrupt, truncated or non-GGUF file, an unsupported
    architecture, or tensors that do not fit the architecture.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    metadata = _read_metadata(reader, gguf_path)
    config = build_config(metadata, reader.tensors, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_weights(reader, config, gguf_path, tmp_dir)
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "generation_config.json", _generation_config(metadata, config))
        _write_tokenizer(gguf_path, metadata, tmp_dir)
        _write_json(tmp_dir / SOURCE_MARKER, source_fingerprint(gguf_path))
        _make_readable(tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def source_fingerprint(gguf_path: Path) -> dict[str, Any]:
    """What a cached conversion was made from; a change in any field means reconvert."""
    stat = Path(gguf_path).stat()
    return {
        "source": Path(gguf_path).name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: back to HF's rotate-half row order."""
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    w = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name for a GGUF tensor name, or None if it has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        module = _LAYER_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.weight"
    return None


def build_config(metadata: dict[str, Any], tensors: list[Any], path: Path) -> dict[str, Any]:
    """An HF `LlamaForCausalLM` config.json from GGUF metadata and the tensor list."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    names = {t.name: t for t in tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: llama3-style rope_freqs.weight is not supported")
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: missing tensor token_embd.weight")

    def key(name: str) -> Any:
        full = f"{arch}.{name}"
        if full not in metadata:
            raise ValueError(f"{path}: missing metadata key {full}")
        return metadata[full]

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary (rope dim {rope_dim} != head dim {head_dim})")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(metadata, arch, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for name in ("bos", "eos", "pad"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """HF `rope_scaling` from llama.cpp's `rope.scaling.*` keys (linear and YaRN only)."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: unsupported rope scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _open_reader(path: Path) -> Any:
    """A GGUFReader, with every way a bad file can fail turned into one ValueError."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises struct, index, value and memmap errors
        problem = f"{type(exc).__name__}: {exc}"
        message = f"{path}: not a valid GGUF file, corrupt or truncated ({problem})"
        raise ValueError(message) from exc


def _read_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Scalar and string metadata; large arrays (vocab, merges) are left to the tokenizer."""
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if len(field.data) > 1 and name.startswith("tokenizer.ggml."):
            continue
        try:
            metadata[name] = field.contents()
        except Exception as exc:
            raise ValueError(f"{path}: unreadable metadata key {name} ({exc})") from exc
    return metadata


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """One tensor as fp32 in numpy (row-major) shape, whatever its GGML type."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGML lists dims fastest-first
        return np.array(values, dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ValueError(f"{path}: cannot read tensor {tensor.name} ({exc})") from exc


def _write_weights(reader: Any, config: dict[str, Any], path: Path, out_dir: Path) -> None:
    """Dequantize, rename and un-permute every tensor into one fp32 safetensors file."""
    from safetensors.numpy import save_file

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor"):
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name} for a llama model")
        value = _dequantize(tensor, path)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads:
            value = unpermute_qk(value, heads[kind])
        weights[hf_name] = np.ascontiguousarray(value)
    _check_complete(weights, config, path)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _check_complete(weights: dict[str, np.ndarray], config: dict[str, Any], path: Path) -> None:
    """Fail at conversion time, not at load time, when a layer's tensor is missing."""
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        expected += [f"model.layers.{i}.{module}.weight" for module in _LAYER_NAMES.values()]
    missing = [name for name in expected if name not in weights]
    if missing:
        more = "..." if len(missing) > 4 else ""
        raise ValueError(f"{path}: missing tensors {', '.join(missing[:4])}{more}")


def _generation_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """eos plus llama.cpp's end-of-turn/message ids, which also end generation."""
    eos_ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    generation: dict[str, Any] = {"_from_model_config": True}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return generation


def _write_tokenizer(gguf_path: Path, metadata: dict[str, Any], out_dir: Path) -> None:
    """Build the tokenizer with transformers' GGUF support and save it as HF files."""
    if "tokenizer.ggml.model" not in metadata:
        raise ValueError(f"{gguf_path}: no tokenizer in the GGUF metadata")
    # The fast-tokenizer class straight away, not AutoTokenizer: for llama files AutoTokenizer first
    # builds a model config through a slow full metadata parse (~10 s on SmolLM2), only to pick
    # this same class. The tokenizer built is identical.
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as exc:
        raise ValueError(f"{gguf_path}: cannot build tokenizer ({exc})") from exc
    template = metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    _patch_tokenizer_config(out_dir / "tokenizer_config.json", metadata)


def _patch_tokenizer_config(config_path: Path, metadata: dict[str, Any]) -> None:
    """Record add_bos explicitly (our Tokenizer reads it) and drop loader-only keys."""
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    for loader_key in ("is_local", "local_files_only"):
        config.pop(loader_key, None)
    _write_json(config_path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_readable(model_dir: Path) -> None:
    """mkdtemp creates the directory private; a model cache is meant to be shared."""
    model_dir.chmod(0o755)
    for path in model_dir.iterdir():
        path.chmod(0o644)


def _replace_dir(new_dir: Path, target: Path) -> None:
    """Move `new_dir` to `target`; an existing target is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
    os.rename(new_dir, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
