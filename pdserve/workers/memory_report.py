"""A worker's memory as its Stats report it: RSS and PSS of the process, the bytes its weights
and its KV pool take (docs/observability.md, "Memory").

PSS divides each shared page among the processes mapping it (libraries, a weight file mapped
by every worker, a decode worker's KV pool in /dev/shm that prefill workers write into), so
the workers' PSS add up to what the host gives them; RSS counts shared pages in full in each.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn

SMAPS_ROLLUP = "/proc/self/smaps_rollup"
STATM = "/proc/self/statm"
REFRESH_S = 1.0  # RSS, from the kernel's counters (~10 us)
# PSS needs the kernel's walk of every page of every mapping: 13 ms in a 1B Q4_K_M worker, 30 ms
# in a SmolLM2-135M one with the default KV pool (2 GB resident). Taken this seldom.
PSS_REFRESH_S = 30.0


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


def resident_bytes(path: str = STATM) -> int:
    """This process's RSS from the kernel's counters (statm's second field, in pages): no walk
    of the mappings; 0 where there is no statm."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


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
    """The memory fields of a worker's Stats, re-read by `refresh()`, which the worker's
    heartbeat thread calls. RSS comes from the kernel's counters every REFRESH_S; PSS from
    smaps_rollup only every PSS_REFRESH_S: its walk takes 13-30 ms of a core, and on a host
    whose cores all run a step's kernel threads, a thread beside the step stalls that step as
    long (the kernel threads wait for each other at every barrier), whether it is this
    worker's heartbeat thread or an idle neighbour worker's."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor) -> None:
        self.weight_bytes = held_weight_bytes(model)
        self.weights_widened = dict(Counter(getattr(model, "widened_weights", {}).values()))
        self.kv_pool_bytes = kv_cache.numel() * kv_cache.element_size()
        self._rss_pss = process_memory()
        self._read_at = self._pss_read_at = time.monotonic()

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        if now - self._pss_read_at >= PSS_REFRESH_S:
            self._rss_pss, self._pss_read_at = process_memory(), now
        elif rss := resident_bytes():
            self._rss_pss = (rss, self._rss_pss[1])

    def fields(self) -> dict[str, Any]:
        rss, pss = self._rss_pss  # one tuple, replaced whole by refresh() on another thread
        return {
            "rss_bytes": rss,
            "pss_bytes": pss,
            "weight_bytes": self.weight_bytes,
            "kv_pool_bytes": self.kv_pool_bytes,
            "weights_widened": self.weights_widened,
        }
