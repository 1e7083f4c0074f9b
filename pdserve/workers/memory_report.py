"""A worker's memory as its Stats report it: RSS and PSS of the process, the bytes its weights
and its KV pool take (docs/observability.md, "Memory").

PSS divides each shared page among the processes mapping it (libraries, a weight file mapped
by every worker, a decode worker's KV pool in /dev/shm that prefill workers write into), so
the workers' PSS add up to what the host gives them; RSS counts shared pages in full in each.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn

SMAPS_ROLLUP = "/proc/self/smaps_rollup"
REFRESH_S = 1.0  # the kernel walks every mapping to sum smaps_rollup: not at every step


def process_memory(path: str = SMAPS_ROLLUP) -> tuple[int, int]:
    """(RSS, PSS) of this process in bytes; (0, 0) where the kernel has no smaps_rollup."""
    found = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return found.get("Rss", 0), found.get("Pss", 0)


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model's modules hold: parameters and buffers, and the
    weights linear layers keep outside them (cpu_linear.PackedLinear's oneDNN tensor, its
    native panels; quant_linear's views of a mapped GGUF file). A tensor shared by two
    modules (tied embeddings) counts once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = id(t) if t.is_mkldnn else t.data_ptr()  # oneDNN's blocked tensors: no storage
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    def add_array(a: np.ndarray) -> None:
        nonlocal total
        key = a.__array_interface__["data"][0]
        if key not in seen:
            seen.add(key)
            total += a.nbytes

    def add_value(value: object) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            add(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                add_value(item)
        elif hasattr(value, "qtype") and isinstance(value.data, np.ndarray):  # QuantTensor
            add_array(value.data)
        elif isinstance(getattr(value, "nbytes", None), int):  # native.PanelWeight
            total += value.nbytes

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor)
    for module in model.modules():
        for value in vars(module).values():
            add_value(value)
    return total


class MemoryReport:
    """The memory fields of a worker's Stats. RSS and PSS are re-read by `refresh()` (at most
    every REFRESH_S), which the worker's heartbeat thread calls: summing smaps_rollup took
    2-13 ms in a 1B GGUF worker on a 2-core host, a token's whole step stalled on the loop
    thread once a second, while beside the step it only shares the cores."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor) -> None:
        self.weight_bytes = held_weight_bytes(model)
        self.weights_widened = dict(Counter(getattr(model, "widened_weights", {}).values()))
        self.kv_pool_bytes = kv_cache.numel() * kv_cache.element_size()
        self._rss_pss = process_memory()
        self._read_at = time.monotonic()

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self._rss_pss, self._read_at = process_memory(), now

    def fields(self) -> dict[str, Any]:
        rss, pss = self._rss_pss  # one tuple, replaced whole by refresh() on another thread
        return {
            "rss_bytes": rss,
            "pss_bytes": pss,
            "weight_bytes": self.weight_bytes,
            "kv_pool_bytes": self.kv_pool_bytes,
            "weights_widened": self.weights_widened,
        }
