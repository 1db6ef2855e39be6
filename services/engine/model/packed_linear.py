"""fp32 linear layers on the CPU with a oneDNN-packed copy of their weight, for the row counts
where it wins.

MKL's GEMM (what F.linear runs) is at its best at one row (a matrix-vector product) and at prefill
sizes, but a handful of rows costs it nearly as much as that many separate products: on the 2-core
development machine a [2816, 512] weight took 0.41 ms at 5 rows against 0.21 ms at one. oneDNN's
GEMM on a weight packed into its blocked layout takes those rows at 0.6x F.linear's time (0.45-0.9x
from 4 to 64 rows, for weights of half a million elements or more), and loses at 1-3 rows and on
small weights (docs/engine.md has the table). So a layer keeps both: F.linear on the original weight
for 1-3 rows and for prefill-sized steps, the packed copy for 4-128 rows: decode batches and
speculative verification rows. The choice is a fixed rule of the row count, never timed at start-up,
so the numbers a step computes do not depend on the machine's load. Those weights take twice the
memory (`EngineConfig.packed_weights` turns it off).

Under the compiler the packed product is an opaque op (`pipeserve::packed_linear`): Inductor cannot
take a oneDNN tensor as a graph input, so the op finds the packed weight by its handle.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS, MAX_ROWS = 4, 128
MIN_ELEMENTS = 512 * 1024  # smaller weights gain too little, or lose
PACK_HINT_ROWS = 32  # the row count oneDNN chooses the packed layout for (4-2048 rows all gain from it)

# Packed weights by handle (oneDNN tensors are not graph inputs); a layer's entry goes with it.
_PACKED: dict[int, torch.Tensor] = {}
_HANDLES = itertools.count()


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def _packed_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 handle: int) -> torch.Tensor:
    packed = _PACKED[handle]
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out


_OPS = torch.library.Library("pipeserve", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor")  # type: ignore[no-untyped-call]
_OPS.impl("packed_linear", _packed_impl, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("pipeserve::packed_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class PackedLinear(nn.Module):
    """nn.Linear's weight and bias, plus the packed copy for 4-128 rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_HINT_ROWS)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = packed
        weakref.finalize(self, _PACKED.pop, self.handle, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS:
            out: torch.Tensor = torch.ops.pipeserve.packed_linear(x, self.weight, self.bias, self.handle)
            return out
        return F.linear(x, self.weight, self.bias)


def packs(module: nn.Module) -> bool:
    """Whether pack_linears swaps this module: a plain fp32 CPU nn.Linear of a large enough weight."""
    return (type(module) is nn.Linear and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and module.weight.numel() >= MIN_ELEMENTS)


def pack_linears(model: nn.Module) -> int:
    """Swap every layer packs() accepts for a PackedLinear; the number swapped."""
    if not available():
        return 0
    # The LM head's weight is read by compute_logits directly (it may be the tied embedding).
    targets = [(name, m) for name, m in model.named_modules() if packs(m) and not name.endswith("lm_head")]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        assert isinstance(module, nn.Linear)
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear(module))
    return len(targets)
