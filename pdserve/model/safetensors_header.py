"""A Hugging Face checkpoint's tensors as views of its read-only mapped .safetensors files,
and the rule for reading them in place. No torch: the launcher's memory check
(engine/memory.py) reads `in_place_bytes` from the headers alone.

A .safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range after the header, then the tensors, row-major. The header
is parsed here, not through `safetensors.safe_open(framework="numpy")`, because its `get_tensor`
copies: reading a 200 MB fp32 tensor raised the process's RSS by 381 MB (safetensors 0.8.0).
Every range is checked against the file and the dtype's size before a view is taken.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# safetensors dtype -> (ggml type id the kernels read, bytes a value).
KERNEL_TYPES = {"F32": (0, 4), "F16": (1, 2), "BF16": (30, 2)}
# Float types the kernels cannot read -> bytes a value: a matrix of one of them in a checkpoint
# read in place is widened to fp32 at load (safetensors_weights.py counts and logs it).
WIDENED_TYPES = {"F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# The format caps a header at 100 MB; a longer one is no safetensors header.
MAX_HEADER_BYTES = 100_000_000
# A sharded checkpoint's map of tensor names to the files holding them (transformers writes it).
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor of a mapped file: its safetensors dtype name, shape and bytes (a read-only
    uint8 view of the file's mapping, which it keeps open)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's .safetensors files: the shards its `model.safetensors.index.json` names
    (a repository may ship another format's file beside them, as Mistral's
    `consolidated.safetensors`), else every *.safetensors file of the directory."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if not index.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {model_dir}")
        return files
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"corrupt weights index {index}: {e}") from None
    for name in sorted(names):
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{index} names {name!r}, not a file of {model_dir}")
        if not (model_dir / name).is_file():
            raise ValueError(f"{index} names {name}, which {model_dir} lacks")
    return [model_dir / name for name in sorted(names)]


def map_checkpoint(model_dir: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint's .safetensors files (`checkpoint_files`), each a view of
    its file's read-only mapping; ValueError naming the file."""
    entries: dict[str, Entry] = {}
    for path in checkpoint_files(model_dir):
        for name, entry in map_file(path).items():
            if name in entries:
                raise ValueError(f"{path}: tensor {name} is also in another weights file")
            entries[name] = entry
    return entries


def map_file(path: Path) -> dict[str, Entry]:
    """One .safetensors file's tensors as views of its read-only mapping."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if not 0 < header_len <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {header_len}")
            header = json.loads(f.read(header_len))
        mapped = np.memmap(path, np.uint8, mode="r")
        header.pop("__metadata__", None)
        return {name: _entry(info, mapped, 8 + header_len) for name, info in sorted(header.items())}
    except (OSError, ValueError, struct.error, AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt weights file {path}: {e}") from None


def _entry(info: dict[str, Any], mapped: np.ndarray, start: int) -> Entry:
    begin, end = (int(x) for x in info["data_offsets"])
    shape = tuple(int(x) for x in info["shape"])
    dtype = str(info["dtype"])
    if not 0 <= begin <= end <= mapped.size - start or min(shape, default=1) < 0:
        raise ValueError(f"bytes [{begin}, {end}) of shape {list(shape)} lie outside the file")
    if dtype in KERNEL_TYPES or dtype in WIDENED_TYPES:
        itemsize = KERNEL_TYPES[dtype][1] if dtype in KERNEL_TYPES else WIDENED_TYPES[dtype]
        if end - begin != itemsize * math.prod(shape):
            raise ValueError(f"{end - begin} bytes do not hold a {dtype} {list(shape)}")
    return Entry(dtype, shape, mapped[start + begin : start + end])


def reads_in_place(entries: dict[str, Entry]) -> bool:
    """The rule: a checkpoint with BF16 or F16 matrices, all others of a type the kernels read
    (F32) or one widened to fp32 at load (WIDENED_TYPES), is read in place. An fp32 checkpoint
    loads as fp32 tensors (the panel kernels and oneDNN run it; the tiny models tests compare
    to transformers are fp32), as does one of other types (I8, ...), by loader.py."""
    types = {e.dtype for e in entries.values() if len(e.shape) == 2}
    return bool(types & {"BF16", "F16"}) and types <= KERNEL_TYPES.keys() | WIDENED_TYPES.keys()


def in_place_bytes(model_dir: Path) -> int:
    """The bytes of the matrices a worker of `model_dir` maps in place (0: none: it loads the
    checkpoint as fp32), for memory estimates; headers are read, no weight. A widened matrix
    (WIDENED_TYPES) is each worker's own fp32 copy, not counted here."""
    entries = map_checkpoint(model_dir)
    if not reads_in_place(entries):
        return 0
    return sum(
        e.data.nbytes for e in entries.values() if len(e.shape) == 2 and e.dtype in KERNEL_TYPES
    )


def widened_bytes(model_dir: Path) -> int:
    """The fp32 bytes of the matrices a worker of `model_dir` widens at load (WIDENED_TYPES in
    a checkpoint read in place: each worker's own copy), for memory estimates."""
    entries = map_checkpoint(model_dir)
    if not reads_in_place(entries):
        return 0
    return sum(
        4 * math.prod(e.shape)
        for e in entries.values()
        if len(e.shape) == 2 and e.dtype in WIDENED_TYPES
    )
