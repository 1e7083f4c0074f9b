"""Prepacked oneDNN GEMMs for CPU linear layers — a transform applied after loading.

On this project's CPUs (AMD EPYC, AVX2) PyTorch's default fp32 `F.linear` goes through MKL,
which leaves a lot on the table at the shapes serving uses: measured on 2 cores, oneDNN with
weights reordered once into its blocked layout runs batch-32 decode GEMMs at ~71 GFLOP/s vs
~47, prefill-sized GEMMs at ~127 vs ~90, and batch-1 GEMV at ~10.6 GB/s vs ~6.4
(benchmarks/bench_engine.py reports the end-to-end effect). The model code stays plain
`nn.Linear`; `pack_linears` swaps the modules, and `F.linear` remains the reference the
tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout (fp32, CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    p = next(model.parameters())
    return (
        p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
