"""A GGUF file's scalar metadata and tensor list, read from its header alone.

`gguf.GGUFReader` builds a numpy view of every metadata item, 100,000 of them for the
default model's tokenizer: 3-9 s on this project's 2-core VMs, for each `pdserve up`. The
launcher's memory check (engine/memory.py) needs only the model's shape keys and each
tensor's type and shape, so this walks the header with `struct` and skips arrays by their
lengths (~0.1 s). Layout: the GGUF specification (ggml's docs/gguf.md), version 2 and 3.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

MAGIC = b"GGUF"
# Value types: struct format of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost dimension first
    tensor_type: GGMLQuantizationType


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
            return _parse(buf)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a valid GGUF file, corrupt or truncated ({exc})") from None


def _parse(buf: Any) -> tuple[dict[str, Any], list[TensorInfo]]:
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
        cur.take("<Q")  # data offset
        tensors.append(TensorInfo(name, shape, tensor_type))
    return metadata, tensors
