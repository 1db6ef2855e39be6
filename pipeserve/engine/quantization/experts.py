"""Quantized replacements of a mixture of experts' routed experts (model/moe.py's Experts), built from
the loaded float experts at load time. Every expert's gate/up and down weights are quantized like a
dense layer's (weights.py): W8A8 int8 / fp8 with one scale per output channel of each expert, its
activations quantized per token inside the fused MoE; W4A16 int4 / nf4 in groups along K, each
expert packed in the W4A16 GEMM's layout and stacked. The router stays in float."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.engine.backend import Backend

from .weights import quantize_4bit, quantize_per_channel


def _per_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (codes [E, N, K], fp32 scales [E, N]): every expert's rows are output channels."""
    q, scale = quantize_per_channel(w.flatten(0, 1), dtype)
    return q.view(w.shape), scale.view(w.shape[:2])


class W8A8Experts(nn.Module):
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
                 quant_dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        for name, w in (("w13", w13), ("w2", w2)):
            q, scale = _per_channel(w.detach(), quant_dtype)
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)
        self.top_k, self.renormalize = top_k, renormalize
        self.backend = backend

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe_w8a8(x, router_logits, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                           self.top_k, self.renormalize)


class W4A16Experts(nn.Module):
    w13: torch.Tensor
    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor | None
    w2: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor | None

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool, fmt: str,
                 backend: Backend) -> None:
        super().__init__()
        for name, w in (("w13", w13), ("w2", w2)):
            packed = [quantize_4bit(expert, fmt) for expert in w.detach()]
            self.register_buffer(name, torch.stack([p.qweight for p in packed]))
            self.register_buffer(f"{name}_scales", torch.stack([p.scales for p in packed]))
            zeros = [p.zeros for p in packed if p.zeros is not None]
            self.register_buffer(f"{name}_zeros", torch.stack(zeros) if zeros else None)
        self.top_k, self.renormalize = top_k, renormalize
        self.fmt = fmt
        self.backend = backend

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe_w4a16(
            x, router_logits, self.w13, self.w13_scales, self.w13_zeros,
            self.w2, self.w2_scales, self.w2_zeros, self.top_k, self.renormalize,
        )
