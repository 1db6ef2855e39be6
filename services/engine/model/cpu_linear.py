"""fp32 linear layers on the CPU: 4-8 rows at a time through the native small-row product.

F.linear runs MKL, which streams a weight at full memory speed for one or two rows but several times
slower per byte for a few more: on the 2-core development machine, over weights too large for the
caches, 5 rows of a [2816, 512] weight took 4x one row's time. Decode batches of a few requests and
speculative verification rows (1 + k rows per request) live there. The native product
(backend/native.py, csrc/small_gemm.cpp) reads the weight once for up to 8 rows: 0.49-0.93x
F.linear's time at 4-8 rows on weights of half a million elements or more, level at 1-3 rows and
on smaller weights, slower from 16 rows (`pipeserve bench cpu-ops`; docs/engine.md). So 4-8 rows of
such weights take it and everything else stays on F.linear. The rule is fixed by
row count, so a step's numbers never depend on timing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.backend import native

MIN_ROWS, MAX_ROWS = 4, 8
MIN_ELEMENTS = 512 * 1024


class CpuLinear(nn.Module):
    """nn.Linear's weight and bias; MIN_ROWS-MAX_ROWS rows go through the native product."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS and native.supports_linear(x, self.weight):
            return native.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def swaps(module: nn.Module) -> bool:
    """Whether use_cpu_linears swaps this module: a plain fp32 nn.Linear on the CPU whose weight is
    large enough for the native product to gain."""
    return (type(module) is nn.Linear and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and module.weight.numel() >= MIN_ELEMENTS)


def use_cpu_linears(model: nn.Module) -> int:
    """Swap every layer swaps() accepts for a CpuLinear (same parameters); the number swapped. The LM
    head is left: compute_logits reads its weight directly (it may be the tied embedding)."""
    targets = [(name, m) for name, m in model.named_modules() if swaps(m) and not name.endswith("lm_head")]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        assert isinstance(module, nn.Linear)
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, CpuLinear(module))
    return len(targets)
