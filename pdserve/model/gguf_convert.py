"""Convert a GGUF file (llama, qwen2, qwen3, phi3) into a Hugging Face model directory.

Which files are read in place, and which converted to fp32 (`reads_in_place`, the loading
rule): a file is read in place from its mapped blocks (gguf_weights.py) unless every matrix is
F32/Q4_0/Q4_1/Q8_0 and its fp32 copy is at most `gguf_fp32_max_bytes` (EngineConfig; 1 GiB by
default). Such a small file is converted to fp32 as below: the compact panels re-encode those
types losslessly (panel_codec.py), decode runs as one native call a step with fp32 activations,
and the tokens are transformers' own; the price, a private fp32 copy and packed panels in every
worker (~2x the fp32 bytes at its start, engine/memory.py), is small against any host at that
size (SmolLM2-135M Q4_1: 0.54 GB fp32). Past it, a file is read in place: one page-cache copy
per host, no fp32 copy on disk or in memory (a Llama 3.2 1B Q8_0 worker: 1.7 GiB against 6.4
converted, docs/observability.md).
A directory read in place holds the config, the tokenizer and a marker naming the file.

The engine loads one format (HF config + safetensors + tokenizer files), so GGUF support is a
one-time conversion rather than a second loader. The config is built here, from the metadata
this server supports (and rejects the rest by name); tensors are dequantized with the `gguf`
package, then named and un-permuted (llama.cpp reorders Q/K rows for its RoPE layout) by
transformers' GGUF loading code, giving the same fp32 values transformers loads.

The output is written into a temporary sibling directory and renamed into place at the end, so an
interrupted conversion never leaves a half-written model behind; what a killed one leaves (no
cleanup runs on SIGKILL) the next conversion of that model removes (registry.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.config import EngineConfig

# llama.cpp's architecture name -> the Hugging Face class of the same weights (Mistral's GGUFs
# are "llama"). Only llama's Q/K rows are permuted by llama.cpp's converter.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(HF_ARCHITECTURES)
SOURCE_MARKER = "pdserve_source.json"
# Bump when the output format changes, so caches written by an older converter are redone.
CONVERTER_VERSION = 2
LOADER_KEYS = ("is_local", "local_files_only")  # from_pretrained's, not the tokenizer's

# ggml type ids the kernels read (gguf.GGMLQuantizationType values) -> (values, bytes) a block.
BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    30: (1, 2),  # BF16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
# Types a small file may be converted in (the loading rule, module docstring): the compact
# panels rebuild them losslessly (panel_codec.py).
PANEL_TYPES = frozenset({0, 2, 3, 8})  # F32, Q4_0, Q4_1, Q8_0


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def check_types(tensors: list[Any], path: Path) -> None:
    """ValueError naming the first tensor whose type the kernels do not read."""
    for t in tensors:
        if int(t.tensor_type) not in BLOCKS:
            raise ValueError(
                f"{path}: tensor {t.name} has type {type_name(int(t.tensor_type))}, which "
                f"pdserve does not run (supported: "
                f"{', '.join(type_name(q) for q in sorted(BLOCKS))})"
            )


def reads_in_place(tensors: list[Any], fp32_max_bytes: int) -> bool:
    """The loading rule (module docstring): whether a file's weights are read in place from
    the file, rather than converted to fp32. Any matrix type outside PANEL_TYPES (K-quants,
    Q5_0/Q5_1, F16, BF16), or an fp32 copy over `fp32_max_bytes`, means in place."""
    if any(int(t.tensor_type) not in PANEL_TYPES for t in tensors):
        return True
    return fp32_bytes(tensors) > fp32_max_bytes


def fp32_bytes(tensors: list[Any]) -> int:
    """The bytes of every tensor of a file as fp32 (what its conversion writes)."""
    return 4 * sum(math.prod(int(n) for n in t.shape) for t in tensors)


def convert_gguf(gguf_path: Path, out_dir: Path, in_place: bool | None = None) -> Path:
    """Convert `gguf_path` into an HF-format directory at `out_dir` (replaced if present):
    with no weights if `in_place` (gguf_weights.py reads the file), else with fp32 ones;
    None: as the loading rule says at the knob's default.

    Raises ValueError naming the file for a corrupt, truncated or non-GGUF file, an unsupported
    architecture, tensors that do not fit the architecture, or (in place) a type the kernels
    do not read.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    metadata = _read_metadata(reader, gguf_path)
    config = build_config(metadata, reader.tensors, gguf_path)
    if in_place is None:
        in_place = reads_in_place(reader.tensors, EngineConfig.gguf_fp32_max_bytes)
    if in_place:
        check_types(reader.tensors, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=_aside(out_dir, "tmp"), dir=out_dir.parent))
    marker = source_fingerprint(gguf_path)
    if in_place:  # the model reads the file's blocks (gguf_weights.py): no weights written
        marker |= {"weights": "in_place", "gguf_path": str(gguf_path.resolve())}
    try:
        if not in_place:
            _write_weights(reader, config, gguf_path, tmp_dir)
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "generation_config.json", _generation_config(metadata, config))
        _write_tokenizer(gguf_path, metadata, tmp_dir)
        _write_json(tmp_dir / SOURCE_MARKER, marker)
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
        "path": str(Path(gguf_path).resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def build_config(metadata: dict[str, Any], tensors: list[Any], path: Path) -> dict[str, Any]:
    """An HF config.json (the class of HF_ARCHITECTURES) from GGUF metadata and the tensors."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    names = {t.name: t for t in tensors}
    if "rope_factors_long.weight" in names:
        raise ValueError(f"{path}: longrope (Phi-3 128k rope_factors_long) is unsupported")
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
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
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
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if (rope_scaling := _rope_scaling(metadata, arch, path)) is not None:
        config["rope_scaling"] = rope_scaling
    if "rope_freqs.weight" in names:  # Llama 3.1+: llama3 scaling as per-frequency divisors
        if rope_scaling is not None:
            raise ValueError(f"{path}: both rope_freqs.weight and rope scaling {rope_scaling}")
        factors = np.asarray(names["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        config["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    if (window := metadata.get(f"{arch}.attention.sliding_window")) is not None:
        config["sliding_window"] = int(window)
    for name in ("bos", "eos", "pad"):
        if (token_id := metadata.get(f"tokenizer.ggml.{name}_token_id")) is not None:
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
    if (original := metadata.get(f"{arch}.rope.scaling.original_context_length")) is not None:
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
        raise ValueError(
            f"{path}: not a valid GGUF file, corrupt or truncated ({problem})"
        ) from exc


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


def _write_weights(reader: Any, config: dict[str, Any], path: Path, out_dir: Path) -> None:
    """Every tensor as fp32 under its HF name, into one safetensors file: dequantized by the
    `gguf` package, named and un-permuted by transformers' own GGUF loading code (so the
    values are those transformers loads from the file)."""
    import torch
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    arch = config["model_type"]
    # rope_freqs.weight is read into the config (freq_factors), which transformers' classes
    # do not know; the meta model below only gives parameter names.
    skip = ("model_type", "rope_scaling", "sliding_window")
    # Special ids default to None: a class's own defaults (Phi-3's pad id 32000) may lie
    # outside a file's vocabulary.
    shape = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))
    shape |= {k: v for k, v in config.items() if k not in skip}
    with torch.device("meta"):  # only its parameter names are used
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **shape))
    # LlamaTensorProcessor undoes llama.cpp's Q/K row permutation (llama files only).
    processor = (LlamaTensorProcessor if arch == "llama" else TensorProcessor)(config)
    hf_names = get_gguf_hf_weights_map(model, processor)
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor"):
        if tensor.name == "rope_freqs.weight":
            continue
        if tensor.name not in hf_names:
            raise ValueError(f"{path}: unexpected tensor {tensor.name} for a {arch} model")
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
            values = processor.process(weights=values, name=tensor.name).weights
        except Exception as exc:
            raise ValueError(f"{path}: cannot read tensor {tensor.name} ({exc})") from exc
        weights[hf_names[tensor.name]] = np.ascontiguousarray(values, dtype=np.float32)
    # Fail at conversion time, not at load time, when a layer's tensor is missing.
    missing = [n for n in model.state_dict() if n not in weights and n != "lm_head.weight"]
    if missing:
        more = "..." if len(missing) > 4 else ""
        raise ValueError(f"{path}: missing tensors {', '.join(missing[:4])}{more}")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _generation_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """eos plus llama.cpp's end-of-turn/message ids, which also end generation."""
    ids = (metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom"))
    eos_ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
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
    _write_json(config_path, {k: v for k, v in config.items() if k not in LOADER_KEYS})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_readable(model_dir: Path) -> None:
    """mkdtemp creates the directory private; a model cache is meant to be shared."""
    model_dir.chmod(0o755)
    for path in model_dir.iterdir():
        path.chmod(0o644)


def _aside(out_dir: Path, kind: str) -> str:
    """The name prefix of a directory beside `out_dir` while it is written ("tmp") or
    replaced ("old")."""
    return f".{out_dir.name}.{kind}-"


def leftovers(out_dir: Path) -> list[Path]:
    """The directories beside `out_dir` that conversions into it write or move aside: once no
    conversion runs (the caller holds the conversion lock), what killed ones left."""
    return [d for kind in ("tmp", "old") for d in out_dir.parent.glob(_aside(out_dir, kind) + "*")]


def _replace_dir(new_dir: Path, target: Path) -> None:
    """Move `new_dir` to `target`; an existing target is moved aside first, then deleted."""
    old = target.parent / (_aside(target, "old") + uuid.uuid4().hex[:8])
    if target.exists():
        os.rename(target, old)
    os.rename(new_dir, target)
    shutil.rmtree(old, ignore_errors=True)
