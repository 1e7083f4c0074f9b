"""Prepacked oneDNN GEMMs for CPU linear layers — a transform applied after loading.

On this project's CPUs (AMD EPYC, AVX2) PyTorch's default fp32 `F.linear` goes through MKL,
which leaves a lot on the table at the shapes serving uses: measured on 2 cores, oneDNN with
weights reordered once into its blocked layout runs batch-32 decode GEMMs at ~71 GFLOP/s vs
~47, prefill-sized GEMMs at ~127 vs ~90, and batch-1 GEMV at ~10.6 GB/s vs ~6.4
(benchmarks/bench_engine.py reports the end-to-end effect). The model code stays plain
`nn.Linear`; `pack_linears` swaps the modules, and `F.linear` remains the reference the
tests compare against.

With the native kernels (`native.py`) a linear can instead (decode workers) or also
(collocated workers, which see both prefill chunks and decode batches) keep its weight packed
in panels (24 or 48 columns, the kernel variant's width) for `native.linear_panels`, which
runs inputs of up to `native.PANEL_M_MAX` rows: at batch 1 it streams the weight with every
thread where oneDNN's GEMV uses one core, and up to batch 64 it matches or beats oneDNN's
GEMM (benchmarks/bench_kernels.py). Panels of weights that came from a GGUF file are stored in a
lossless 4- or 8-bit form (panel_codec.py), 3.5-5x fewer bytes to stream per step. A
prefill-only worker keeps such compact panels beside oneDNN's copy too: a short prompt's
chunk (up to `PANEL_M_MAX` rows) and the logits of its last token run on them as on a
collocated worker (without them a 32-token prompt's step on one AVX-512 thread takes
1.8-2.1x as long); fp32 panels, which stream the same bytes as oneDNN's copy, it does not keep. With
the AMX kernels, whose GEMM on compact panels beats oneDNN at every size, compact panels are
the only copy, in every role (`native.panels_take_any_rows`).
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter

import torch
from torch import nn

from pdserve.model import native, panel_codec

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """`nn.Linear` for fp32 on the CPU, its weight prepacked for oneDNN, for the native
    panel kernel, or both (then small inputs take the panel kernel)."""

    def __init__(
        self,
        linear: nn.Linear,
        panels: ctypes.CDLL | None = None,
        onednn: bool = True,
        decode: bool = True,
    ) -> None:
        """`decode=False` (a prefill worker): fp32 panels are not kept (oneDNN's copy
        streams the same bytes); compact ones are, for inputs of up to `PANEL_M_MAX` rows."""
        super().__init__()
        if panels is None and not onednn:
            raise ValueError("a PackedLinear needs the oneDNN weights, the panel kernel or both")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.panel_weight = (
            native.pack_panels(panels, linear.weight) if panels is not None else None
        )
        # On AMX kernels compact panels run prefill-sized inputs too, faster than oneDNN's
        # fp32 GEMM, so no oneDNN copy is kept for them.
        any_rows = native.panels_take_any_rows(panels, self.panel_weight)
        if not decode and self.panel_weight is not None:
            if self.panel_weight.codec == panel_codec.F32:
                self.panel_weight = None
        self.lib = panels if self.panel_weight is not None else None
        onednn = (onednn or self.lib is None) and not any_rows
        self.packed_weight = (
            torch.ops.mkldnn._reorder_linear_weight(linear.weight, None) if onednn else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and (
            self.packed_weight is None or x.shape[0] <= native.PANEL_M_MAX
        ):
            return native.linear_panels(
                self.lib, x.reshape(-1, self.in_features), self.panel_weight, self.bias
            ).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    p = next(model.parameters())
    return (
        p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linears(
    model: nn.Module, panels: ctypes.CDLL | None = None, onednn: bool = True, decode: bool = True
) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear` (with the native panel
    kernel when `panels` is the loaded kernel library); returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    num_linears = len(targets)
    # Popped one at a time so each original fp32 weight is freed as soon as it is packed
    # (held in the list until the end, a 1B model's load peaked 2.4 GB higher).
    while targets:
        parent, name, child = targets.pop()
        setattr(parent, name, PackedLinear(child, panels, onednn, decode))
        del child
    return num_linears


def log_panel_formats(model: nn.Module) -> None:
    """One line on how the panel weights are stored: formats, and bytes vs fp32."""
    panels = [
        m.panel_weight for m in model.modules() if getattr(m, "panel_weight", None) is not None
    ]
    if not panels:
        return
    formats = Counter(panel_codec.CODEC_NAMES[p.codec] for p in panels)
    fp32 = sum(p.out_features * p.in_features * 4 for p in panels)
    log.info(
        "decode GEMM weights: %s; %.0f MB (%.0f MB as fp32, lossless either way)",
        ", ".join(f"{n} x{c}" for n, c in formats.most_common()),
        sum(p.nbytes for p in panels) / 1e6,
        fp32 / 1e6,
    )
