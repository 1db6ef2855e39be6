"""fp32 linear layers on the CPU through the native packed product.

F.linear runs MKL, which takes the weight as it lies ([N, K]) and repacks it on every call. For one
row it streams the weight at memory speed; for the few to few dozen rows of a decode step it is
several times slower per byte (on the 2-core development machine, over weights too large for the
caches, a [2816, 512] weight took 248 µs for one row, 933 for 8 and 1,118 for 32). Packed once at
load time into panels of 16 output columns (backend/native.py, csrc/packed_gemm.cpp), the product
needs no repacking and no horizontal sums: 375 and 642 µs there, 0.4-0.8x F.linear's time at 4-32
rows, 0.6-1.0x at one to three, level from a few hundred rows on (`pipeserve bench cpu-ops`;
docs/engine.md). So every row count takes it, and the layer keeps only the packed copy (the
weight's bytes, rounded up to 16 output rows): no second copy of the model.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native

MIN_ELEMENTS = 256 * 1024  # smaller weights: the call's own cost outweighs what packing gains


class CpuLinear(nn.Module):
    """nn.Linear with its weight packed for the native product (the [N, K] weight is not kept)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed: torch.Tensor
        self.register_buffer("packed", native.pack_weight(linear.weight))
        self.bias = linear.bias  # [N], contiguous as nn.Linear makes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = native.packed_linear(rows, self.packed, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def swaps(module: nn.Module) -> bool:
    """Whether use_cpu_linears swaps this module: a plain fp32 nn.Linear on the CPU whose weight is
    large enough for the native product to gain, on a host where the native kernels run."""
    return (type(module) is nn.Linear and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and module.weight.numel() >= MIN_ELEMENTS
            and native.available())


def use_cpu_linears(model: nn.Module) -> int:
    """Swap every layer swaps() accepts for a CpuLinear (the weight packed; the original freed); the
    number swapped. An untied LM head is one of them; a tied one is the embedding, which stays."""
    targets = [(name, m) for name, m in model.named_modules() if swaps(m)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        assert isinstance(module, nn.Linear)
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, CpuLinear(module))
    return len(targets)
