"""fp32 and bf16 linear layers on the CPU: the native packed product for few rows, oneDNN's GEMM
for many, chosen per row count from the measured table (backend/cpu_gemm.py).

F.linear runs MKL, which takes the weight as it lies ([N, K]) and repacks it on every call. For one
row it streams the weight at memory speed; for the few to few dozen rows of a decode step it is
several times slower per byte (on the 2-core development machine, over weights too large for the
caches, a [2816, 512] weight took 248 µs for one row, 933 for 8 and 1,118 for 32). Packed once at
load time into panels of 16 output columns (backend/native.py, csrc/packed_gemm.cpp), the product
needs no repacking and no horizontal sums: 375 and 642 µs there, 0.4-0.8x F.linear's time at 4-32
rows, 0.6-1.0x at one to three (`pipeserve bench cpu-ops`; docs/engine.md). bf16 weights are packed
as bf16 (half the bytes a decode step streams) and multiplied with fp32 accumulation.

Once a product is compute-bound a cache-blocked GEMM wins: where the table says oneDNN beats the
packed product for this shape and dtype, the layer also keeps the weight in oneDNN's layout
(reordered once) and rows from `gemm_from` on take it. Where it never wins, the layer keeps only
the packed copy (the weight's bytes, rounded up to 16 output rows). A model's packed weights lie
together on transparent huge pages (engine/host_memory.py), which a decode step streams faster.
"""

from __future__ import annotations

import torch
from torch import nn

from . import cpu_gemm, native

MIN_ELEMENTS = 256 * 1024  # smaller weights: the call's own cost outweighs what packing gains


class CpuLinear(nn.Module):
    """nn.Linear with its weight packed for the native product (the [N, K] weight is not kept), and
    in oneDNN's layout too where the measured table gives the GEMM a row count from which it wins.
    packed: the weight already packed (native.pack_weights), else packed here."""

    def __init__(self, linear: nn.Linear, gemm_from: int | None = None,
                 packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed: torch.Tensor
        self.register_buffer("packed", native.pack_weight(linear.weight) if packed is None else packed)
        self.bias = linear.bias  # [N], contiguous as nn.Linear makes it
        # The packed product adds an fp32 bias; a bf16 layer keeps an fp32 copy of its own.
        self.bias_f32: torch.Tensor | None
        self.register_buffer("bias_f32", None if linear.bias is None else linear.bias.detach().float())
        self.gemm_from = gemm_from  # rows from which the GEMM runs (None: never)
        self.reordered: torch.Tensor | None
        reordered = None if gemm_from is None else cpu_gemm.reorder(linear.weight, gemm_from)
        self.register_buffer("reordered", reordered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.reordered is not None and self.gemm_from is not None and rows.shape[0] >= self.gemm_from:
            out = cpu_gemm.linear(rows.to(self.dtype), self.reordered, self.bias)
        else:
            out = native.packed_linear(rows, self.packed, self.bias_f32, self.out_features).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, "
                f"dtype={self.dtype}, gemm_from={self.gemm_from}")


def swaps(module: nn.Module) -> bool:
    """Whether use_cpu_linears swaps this module: a plain fp32 or bf16 nn.Linear on the CPU whose
    weight is large enough for the native product to gain, on a host where the native kernels run."""
    return (type(module) is nn.Linear and module.weight.dtype in native.PACKED_DTYPES
            and module.weight.device.type == "cpu" and module.weight.numel() >= MIN_ELEMENTS
            and native.available())


def use_cpu_linears(model: nn.Module) -> int:
    """Swap every layer swaps() accepts for a CpuLinear (the weight packed, and reordered for the
    GEMM where the table says; the original freed); the number swapped. An untied LM head is one
    of them; a tied one is the embedding, which stays. The packed weights share one huge-page region."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and swaps(m)]
    table = cpu_gemm.table()
    packed = native.pack_weights([m.weight for _, m in targets])
    for (name, module), weight in zip(targets, packed, strict=True):
        parent_name, _, attr = name.rpartition(".")
        gemm_from = (table.gemm_from(module.out_features, module.in_features, module.weight.dtype)
                     if cpu_gemm.available(module.weight.dtype) else None)
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, CpuLinear(module, gemm_from, weight))
    return len(targets)


def gemm_rows(linears: list[CpuLinear]) -> int | None:
    """The fewest rows at which most of these layers' weight (by elements) takes the GEMM: from
    there a step runs faster per op than through the packed product alone (None: never)."""
    total = sum(m.in_features * m.out_features for m in linears)
    covered = 0
    for m in sorted((m for m in linears if m.gemm_from is not None), key=lambda m: m.gemm_from or 0):
        covered += m.in_features * m.out_features
        if 2 * covered > total:
            return m.gemm_from
    return None
