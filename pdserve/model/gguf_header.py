"""A GGUF file's scalar metadata and tensor list, read from its header alone.

`gguf.GGUFReader` builds a numpy view of every metadata item, 100,000 of them for the
default model's tokenizer: 3-9 s on this project's 2-core VMs, for each `pdserve up`. The
launcher's memory check (engine/memory.py) needs only the model's shape keys and each
tensor's type and shape, and a worker reading the weights in place (gguf_weights.py) needs
each tensor's bytes too (`map_tensors`: views of one read-only mapping of the file), so this
walks the header with `struct` and skips arrays by their lengths (~0.1 s; GGUFReader took 8 s
of each worker's start on a Llama 3.2 3B file). Layout: the GGUF specification (ggml's
docs/gguf.md), version 2 and 3.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# Value types: struct format of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless `general.alignment` says otherwise


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost dimension first
    tensor_type: GGMLQuantizationType
    offset: int = 0  # of its bytes, from the start of the tensor data


@dataclass(frozen=True)
class MappedTensor:
    """A tensor whose `data` (its bytes, uint8) is a view of the mapped file: no copy."""

    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MappedGGUF:
    """A GGUF file mapped read-only (`data`, the whole file); the mapping lives as long as
    this or any tensor's view."""

    metadata: dict[str, Any]
    tensors: list[MappedTensor]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        """The value, or None for an array (skipped)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        item_type, count = self.take("<I"), self.take("<Q")
        if item_type in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item_type])
        else:
            for _ in range(count):
                self.value(item_type)
        return None


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(scalar and string metadata, tensors) of a GGUF file; ValueError naming the file if it
    is not one or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            metadata, tensors, _ = _parse(buf)
            return metadata, tensors
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a valid GGUF file, corrupt or truncated ({exc})") from None


def map_tensors(path: Path) -> MappedGGUF:
    """The file's metadata, and every tensor as a view of one read-only mapping of it;
    ValueError naming the file if it is not a GGUF file or a tensor lies past its end."""
    path = Path(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        with memoryview(data) as buf:  # slices of a memoryview are cheap, a memmap's not
            metadata, infos, header_end = _parse(buf)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a valid GGUF file, corrupt or truncated ({exc})") from None
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-header_end // align) * align
    tensors = []
    for t in infos:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        first = start + t.offset
        last = first + math.prod(t.shape) // block * type_size
        if last > len(data):
            raise ValueError(f"{path}: not a valid GGUF file, tensor {t.name} ends past the file")
        view = np.asarray(data[first:last])  # a plain view: memmap slicing is slow per item
        tensors.append(MappedTensor(t.name, t.shape, t.tensor_type, view))
    return MappedGGUF(metadata, tensors, data)


def _parse(buf: Any) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """(metadata, tensors, where the header ends)."""
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("no GGUF magic")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    num_tensors, num_keys = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_keys):
        key = cur.string()
        value = cur.value(cur.take("<I"))
        if value is not None:
            metadata[key] = value
    tensors = []
    for _ in range(num_tensors):
        name = cur.string()
        shape = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        tensor_type = GGMLQuantizationType(cur.take("<I"))
        offset = cur.take("<Q")
        tensors.append(TensorInfo(name, shape, tensor_type, offset))
    return metadata, tensors, cur.pos
