"""An adapter's tensors in host memory, laid out for the slot table: per (layer, fused kind) the
stacked A^T [in, n * R] and B [n * R, out] (layout.py), B scaled by the adapter's alpha / r (or
alpha / sqrt(r)), ranks below R zero-padded, in the model's dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from pipeserve.lora import WEIGHTS_FILE, LoRAError, LoRARequest, check_shapes, validate
from pipeserve.model_config import ModelConfig

from .layout import KIND_OF, SUBS, dense_mlp_layers, fused_shapes, projection_sizes


@dataclass
class HostAdapter:
    request: LoRARequest
    rank: int
    scale: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, kind) -> (A^T, B)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(kind for _, kind in self.factors)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> HostAdapter:
    """The adapter at request.lora_path, validated against the model (LoRAError naming the file and
    field at fault)."""
    config, factors = validate(request.lora_path, max_rank)
    check_shapes(factors, projection_sizes(cfg), cfg.num_layers)
    dense = dense_mlp_layers(cfg)
    for f in factors:
        if KIND_OF[f.module] not in ("qkv", "o") and not dense[f.layer]:
            raise LoRAError(f"{WEIGHTS_FILE}: {f.key}: layer {f.layer}'s MLP is a mixture of experts; "
                            "adapters of experts are not supported (target_modules: attention only)")
    try:
        tensors = load_file(os.path.join(request.lora_path, WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the adapter's error, never the engine's
        raise LoRAError(f"{WEIGHTS_FILE} in {request.lora_path!r} cannot be read: {exc}") from None
    shapes = fused_shapes(cfg)
    rank, scale = config.rank, config.scale
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    by_module = {(f.layer, f.module, f.factor): tensors[f.key] for f in factors}
    for layer in sorted({f.layer for f in factors}):
        for kind, modules in SUBS.items():
            present = [m for m in modules if (layer, m, "A") in by_module]
            if not present:
                continue
            shape = shapes[kind]
            a = torch.zeros(len(modules) * max_rank, shape.d_in, dtype=torch.float32, device="cpu")
            b = torch.zeros(len(modules) * max_rank, shape.d_out, dtype=torch.float32, device="cpu")
            for j, (module, offset, size) in enumerate(shape.subs):
                if module not in present:
                    continue
                rows = slice(j * max_rank, j * max_rank + rank)
                a[rows] = by_module[(layer, module, "A")].float()
                b[rows, offset:offset + size] = by_module[(layer, module, "B")].float().t() * scale
            out[(layer, kind)] = (a.t().contiguous().to(dtype), b.to(dtype))
    return HostAdapter(request, rank, scale, out)
