"""Prepacked oneDNN GEMMs for CPU linear layers — a transform applied after loading.

On this project's CPUs (AMD EPYC, AVX2) PyTorch's default fp32 `F.linear` goes through MKL,
which leaves a lot on the table at the shapes serving uses: measured on 2 cores, oneDNN with
weights reordered once into its blocked layout runs batch-32 decode GEMMs at ~71 GFLOP/s vs
~47, prefill-sized GEMMs at ~127 vs ~90, and batch-1 GEMV at ~10.6 GB/s vs ~6.4
(benchmarks/bench_engine.py reports the end-to-end effect). The model code stays plain
`nn.Linear`; `pack_linears` swaps the modules, and `F.linear` remains the reference the
tests compare against.

With the native kernels (`native.py`), a `PackedLinear` also keeps the plain weight and sends
inputs of at most `native.SMALL_M_MAX` rows (batch-1..4 decode) to the C GEMV, which reads the
weight once with every thread: oneDNN's GEMV runs on one core. That costs a second copy of
the linear weights; a prefill-only worker never has such small inputs and skips it.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pdserve.model import native


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout (fp32, CPU only), and
    optionally the plain weight too for the native small-M kernel."""

    def __init__(self, linear: nn.Linear, small_m: ctypes.CDLL | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)
        )
        self.bias = linear.bias
        self.small_m = small_m
        self.weight = linear.weight.detach().contiguous() if small_m is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_m is not None and x.dim() == 2 and x.shape[0] <= native.SMALL_M_MAX:
            return native.linear_small_m(self.small_m, x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    p = next(model.parameters())
    return (
        p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: nn.Module, small_m: ctypes.CDLL | None = None) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear` (with the native small-M
    path when `small_m` is the loaded kernel library); returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, small_m))
    return len(targets)
